"""w8a14's decode row through oneDNN's packed int8 weights by a kernel of qvl's own: AVX-512 VNNI's dot product,
written in LLVM IR through numba, reads the packed weights where oneDNN left them.

For a single row oneDNN's own call is not bound by reading the weights: the 2B's decode step's linears took 95 ms in
this kernel against 107 in oneDNN's call (and 108 in fbgemm's), in the same bytes and the same whole-number sums, and
the 2B decoded 9.3 tok/s against 7.7 (docs/quantization.md, "The decode kernel"). Prompts and a batch's rows stay
oneDNN's: its AMX tiles compute prompts, and from 2 rows on its call was as fast.

The layout is oneDNN's choice, not a promise: qvl reads it as measured (blocks of 64 output channels, each taking
the input 4 values at a time, then a 32-bit compensation per channel holding minus its weights' sum), checks each
packed weight's size against it, and warm() checks the kernel's sums against exact ones on a packed weight before
setting ready. Where anything differs, oneDNN's own call computes the decode row as before.
"""
import ctypes
import logging

import numpy as np
import torch

from qvl.engine import jit

log = logging.getLogger("qvl")
BLOCK = 64  # output channels of one of oneDNN's blocks
_block = None  # the intrinsic, once warm() has made it: a block's sums for a row's two parts
_kernel = None
prange = range  # numba.prange once warm() has imported numba
ready = False


def fits(part) -> bool:
    """Whether part (oneDNN's packed weight, in x out) is laid out as this kernel reads it."""
    if not isinstance(part, torch.Tensor) or not part.is_mkldnn:
        return False
    in_features, out_features = part.shape
    padded = -(-out_features // BLOCK) * BLOCK
    return in_features % BLOCK == 0 and torch.ops.mkldnn._nbytes(part) == padded * (in_features + 4)


class Table:
    """What the kernel reads of a linear's packed parts: each block's address, first output column and channels, and
    each channel's 64 times its weights' sum (the uint8 input's zero point times the compensation). Holds the parts:
    their memory lives as long as the table."""

    def __init__(self, parts: list):
        self.parts = parts
        addresses, starts, counts, sums = [], [], [], []
        start = 0
        for part in parts:
            in_features, out_features = part.shape
            address = torch.ops.mkldnn.data_ptr(part)
            padded = -(-out_features // BLOCK) * BLOCK
            for b in range(0, out_features, BLOCK):
                addresses.append(address + b * in_features)
                starts.append(start + b)
                counts.append(min(BLOCK, out_features - b))
            compensation = (ctypes.c_int32 * padded).from_address(address + padded * in_features)
            # 64 x 127 x in_features at most: int32 holds it up to 2^18 inputs
            sums.append(np.ctypeslib.as_array(compensation)[:out_features] * -64)
            start += out_features
        self.addresses, self.starts, self.counts = (np.array(a, np.int64) for a in (addresses, starts, counts))
        self.offsets = np.concatenate(sums)


def two_part(row: torch.Tensor, table: Table, scale: torch.Tensor) -> torch.Tensor:
    """jit.in_two_parts of one row (1 x in, float32, contiguous) on oneDNN's packed weights: its two uint8 parts, each
    part's sums with every weight row, joined back times scale (the weight rows' scales)."""
    parts = np.empty((2, row.shape[1]), np.uint8)
    level = jit._split(row.numpy(), parts, np.float32(64))[0, 0]
    out = torch.empty(1, len(table.offsets))
    with jit._launch:
        jit._engine_threads()
        _kernel(parts[0], parts[1], level, table.addresses, table.starts, table.counts, table.offsets, scale.numpy(),
                out[0].numpy())
    return out


def _two_part_kernel(high, low, level, addresses, starts, counts, offsets, scale, out):
    """For each block of 64 output channels (over every core): the sums of the row's two parts with the block's
    weights, less the zero point's share, joined as jit._join_kernel joins them."""
    for b in prange(len(addresses)):
        sums = np.empty(2 * BLOCK, np.int32)
        _block(addresses[b], high.ctypes.data, low.ctypes.data, len(high), sums.ctypes.data)
        for j in range(counts[b]):
            n = starts[b] + j
            out[n] = (np.float32(sums[j] - offsets[n]) + np.float32(sums[BLOCK + j] - offsets[n]) * np.float32(1 / 126)
                      ) * level * scale[n]



def _make_block(numba):
    """The intrinsic _block(weights, high, low, in_features, sums): for a block of 64 output channels at address
    weights (in_features / 4 groups of 64 channels x 4 int8 values), the dot products of the uint8 rows high and low
    with each channel, into sums (2 x 64 int32): one vpdpbusd per 64 weights and part, four accumulators a part."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)
    lanes = ir.VectorType(i32, 16)

    @intrinsic
    def block(typingctx, weights, high, low, in_features, sums):
        signature = numba.types.void(*[numba.types.int64] * 5)

        def codegen(context, builder, sig, args):
            weights, high, low, in_features, sums = args
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            zero = ir.Constant(lanes, [0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(2)]
            groups = builder.udiv(in_features, ir.Constant(i64, 4))
            with cgutils.for_range(builder, groups) as loop:
                base = builder.add(weights, builder.mul(loop.index, ir.Constant(i64, 4 * BLOCK)))
                ws = []
                for j in range(4):
                    at = builder.add(base, ir.Constant(i64, 64 * j))
                    ws.append(builder.load(builder.inttoptr(at, lanes.as_pointer()), align=1))
                for acc, row in zip(accs, (high, low)):
                    four = builder.load(builder.inttoptr(builder.add(row, builder.mul(loop.index, ir.Constant(i64, 4))),
                                                         i32.as_pointer()), align=1)
                    x = builder.insert_element(ir.Constant(lanes, None), four, ir.Constant(i32, 0))
                    x = builder.shuffle_vector(x, ir.Constant(lanes, None), ir.Constant(lanes, [0] * 16))
                    for j in range(4):
                        builder.store(builder.call(dot, [builder.load(acc[j]), x, ws[j]]), acc[j])
            for p, acc in enumerate(accs):
                for j in range(4):
                    at = builder.add(sums, ir.Constant(i64, 4 * (p * BLOCK + 16 * j)))
                    builder.store(builder.load(acc[j]), builder.inttoptr(at, lanes.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return block


def warm() -> bool:
    """Compile the kernel (or load it from numba's cache) and check it on a packed weight whose channels do not fill
    its last block; ready where the CPU has AVX-512 VNNI and the layout is as read. False, with one log line, where not."""
    global _block, _kernel, prange, ready
    if ready:
        return True
    try:
        import numba
        from llvmlite import binding
        # LLVM aborts the process on an intrinsic its target lacks: ask numba's target, not only the CPU.
        features = numba.config.CPU_FEATURES or binding.get_host_cpu_features().flatten()
        if "+avx512vnni" not in features.split(","):
            raise ValueError("numba's target has no AVX-512 VNNI")
        _block, prange = _make_block(numba), numba.prange
        _kernel = numba.njit(parallel=True, nogil=True, cache=True)(_two_part_kernel)
        generator = torch.Generator().manual_seed(0)
        weights = torch.randint(-127, 128, (BLOCK + 3, 2 * BLOCK), dtype=torch.int8, generator=generator)
        part = torch.ops.onednn.qlinear_prepack(weights, None)
        if not fits(part):
            raise ValueError(f"oneDNN packed a {tuple(weights.shape)} weight in {torch.ops.mkldnn._nbytes(part)} bytes")
        high, low = torch.randint(1, 128, (2, 2 * BLOCK), dtype=torch.uint8, generator=generator).numpy()
        got = np.empty(BLOCK + 3, np.float32)
        table = Table([part])
        _kernel(high, low, np.float32(1), table.addresses, table.starts, table.counts, table.offsets,
                np.ones(BLOCK + 3, np.float32), got)
        sums = (np.stack([high, low]).astype(np.int64) - 64) @ weights.numpy().astype(np.int64).T
        if not np.allclose(got, sums[0] + sums[1] / 126, rtol=1e-6):
            raise ValueError("its sums differ from the exact ones")
    except Exception as e:  # no AVX-512 VNNI, or oneDNN lays its weights out otherwise
        log.warning("qvl's decode kernel for oneDNN's weights is unavailable (%s: %s); oneDNN's own call decodes, "
                    "slower", type(e).__name__, e)
        return False
    ready = True
    return True
