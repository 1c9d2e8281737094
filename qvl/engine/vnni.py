"""w8a14's decode row through oneDNN's packed int8 weights by a kernel of qvl's own: AVX-512 VNNI's dot product,
written in LLVM IR through numba, reads the packed weights where oneDNN left them.

For a single row oneDNN's own call is not bound by reading the weights: the 2B's decode step's linears took 95 ms in
this kernel against 107 in oneDNN's call (and 108 in fbgemm's), in the same bytes and the same whole-number sums, and
the 2B decoded 9.3 tok/s against 7.7 (docs/quantization.md, "The decode kernel"). So do a batch's rows up to ROWS,
each block's weights read once for them all; prompts and larger batches stay oneDNN's, whose AMX tiles compute them.

Where every linear of every text layer and the head are read so, a decode step is one call (decode()): the token's
embedding row, the layers' norms, rotation and attention (jit's kernels called from this one), the final norm and
the head, with what each reads made once per answer (prepare(), layers(), ends()), instead of ~113 linears' and ~170
small ops', each of which cost more in dispatch than in work (docs/quantization.md, "The decode kernel").

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
# Decode rows up to which the kernel computes an Int8Linear: a batch's step of the 2B took 130 ms against oneDNN's
# 157 for 2 rows, 172 against 188 for 4, and 257 against 233 for 8, where computing the sums costs more than reading.
ROWS = 4
STREAMS, AHEAD = 4, 512  # runs of a block read side by side, and how many bytes ahead each is prefetched
_block = None  # the intrinsic, once warm() has made it: a block's sums for a row's two parts
_sums = _linear = _layer = _decode = _List = None  # the compiled kernels, and numba's typed list
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
    """What the kernels read of an Int8Linear for decode rows: each block's address, first output column and
    channels, each channel's 64 times its weights' sum (the uint8 input's zero point times the compensation), the rows'
    scales, its weight parts (2: each row's levels, then what they rounded off), and its loud channels with their
    weights (none: empty). Holds the parts: their memory lives as long as the table."""

    def __init__(self, parts: list, scale: torch.Tensor, weight_parts: int, apart: torch.Tensor | None,
                 columns: torch.Tensor | None):
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
        if apart is None:
            apart, columns = torch.empty(0, dtype=torch.long), torch.empty(0, start // weight_parts)

        def contiguous(tensor):  # as every table's: decode()'s typed list holds layers of one type
            return np.ascontiguousarray(tensor.numpy())

        self.args = (*(np.array(a, np.int64) for a in (addresses, starts, counts)), np.concatenate(sums),
                     contiguous(scale), int(weight_parts), contiguous(apart), contiguous(columns))


def linear(x: torch.Tensor, table: Table) -> torch.Tensor:
    """An Int8Linear's output, without its bias, for decode rows x (float32, ... x in_features) each in two parts
    (jit.in_two_parts), read from oneDNN's packed weights by the kernel: its loud channels apart, its weight parts
    summed, as Int8Linear.forward computes them around oneDNN's call."""
    with jit._launch:
        jit._engine_threads()
        y = _linear(x.reshape(-1, x.shape[-1]).contiguous().numpy(), table.args)
    return torch.from_numpy(y).view(*x.shape[:-1], -1)


def prepare(norms: tuple, eps: tuple, heads: tuple, scaling: float, qk_weight: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, tables: tuple) -> tuple:
    """What decode() reads of one text decoder layer through an answer: norms (its two RMSNorm weights) and eps
    (theirs, then q/k's norm's), the attention's q and kv heads and scaling, qk_weight as jit.rope takes it, the
    answer's keys and values buffers (kv heads x positions x head_dim), and the tables of its q/k/v, o, gate/up and
    down linears. Every layer's the same types, as the kernels' typed list holds them."""
    dim = keys.shape[-1]
    return (tuple(w.detach().numpy() for w in norms), tuple(map(float, eps)), tuple(map(int, heads)), float(scaling),
            qk_weight.view(-1, dim).numpy(), jit._array(keys), jit._array(values), tuple(t.args for t in tables))


def layers(prepared: list) -> "numba.typed.List":
    """The prepared layers as decode() takes them: a list numba reads without converting each item every call (a
    tuple of 28 layers cost 37 us a call to convert, and a new layer count compiled for 9 s)."""
    typed = _List()
    for layer in prepared:
        typed.append(layer)
    return typed


def ends(embedding: torch.Tensor, norm: torch.Tensor, eps: float, head: Table) -> tuple:
    """What decode() reads around the layers: the token table (bf16, as quantized models keep it), the final norm's
    weight and epsilon, and the head's table."""
    return jit._array(embedding.detach()), norm.detach().numpy(), float(eps), head.args


def decode(token: int, cos: torch.Tensor, sin: torch.Tensor, n: int, layers: "numba.typed.List",
           ends: tuple) -> torch.Tensor:
    """The logits (1 x vocabulary) after feeding token, as lean.step computes them one op at a time, in one call: its
    row of the token table, every text decoder layer, the final norm and the head. cos/sin/n as jit.rope takes them,
    the layers as layers() holds them, the rest as ends() makes it. One call, because each op dispatched from Python
    after the layers have read their weights finds its code and data out of the CPU's caches: the embedding's gather
    and the norm took ~0.4 ms each there, against ~0.01 ms in a loop."""
    with jit._launch:
        jit._engine_threads()
        y = _decode(token, cos.reshape(-1).numpy(), sin.reshape(-1).numpy(), n, layers, *ends)
    return torch.from_numpy(y)


def _sums_kernel(parts, levels, addresses, starts, counts, offsets, scale, out):
    """For each block of 64 output channels (over every core), each row in turn (parts: the rows' high parts, then
    their low parts, as jit._split writes them; the block's weights stay in the core's cache for the next): the sums
    of the row's two parts with the block's weights, less the zero point's share, joined as jit._join_kernel joins
    them."""
    rows, width = len(levels), parts.shape[1]
    for b in prange(len(addresses)):
        sums = np.empty(2 * BLOCK, np.int32)
        for r in range(rows):
            _block(addresses[b], parts[r].ctypes.data, parts[rows + r].ctypes.data, width, sums.ctypes.data)
            for j in range(counts[b]):
                n = starts[b] + j
                out[r, n] = (np.float32(sums[j] - offsets[n])
                             + np.float32(sums[BLOCK + j] - offsets[n]) * np.float32(1 / 126)) * levels[r, 0] * scale[n]


def _linear_kernel(rows, table):
    """linear()'s output for rows (r x in_features, float32): the loud channels out of the split and added back (as
    addmm adds them: their products summed, then added), jit's split into two uint8 parts, the sums, the weight
    parts added."""
    addresses, starts, counts, offsets, scale, weight_parts, apart, columns = table
    r = len(rows)
    loud = np.empty((r, len(apart)), np.float32)
    if len(apart):
        rows = rows.copy()
        for i in range(r):
            for c in range(len(apart)):
                loud[i, c] = rows[i, apart[c]]
                rows[i, apart[c]] = 0
    parts = np.empty((2 * r, rows.shape[1]), np.uint8)
    levels = jit._split(rows, parts, np.float32(64))
    y = np.empty((r, len(offsets)), np.float32)
    _sums(parts, levels, addresses, starts, counts, offsets, scale, y)
    if weight_parts == 2:
        y = y[:, :y.shape[1] // 2] + y[:, y.shape[1] // 2:]
    for i in range(r if len(apart) else 0):
        for j in range(y.shape[1]):
            added = np.float32(0)
            for c in range(len(apart)):
                added += loud[i, c] * columns[c, j]
            y[i, j] += added
    return y


def _decode_kernel(token, cos, sin, n, layers, embedding, norm, eps, head):
    """decode(): the token's row, each layer in turn, the final norm, the head."""
    width = embedding.shape[1]
    x = np.empty(width, np.float32)
    x[:] = jit.widen(embedding[token], np.empty(width, np.uint32))
    for i in range(len(layers)):
        _layer(x, cos, sin, n, *layers[i])
    h = np.empty((1, width), np.float32)
    jit._norm(x.reshape(1, -1), norm, eps, h)
    return _linear(h, head)


def _layer_kernel(x, cos, sin, n, norms, eps, heads, scaling, qk_weight, keys, values, tables):
    """One layer of decode(): x += attention(norm(x)); x += mlp(norm(x)), with jit's kernels for the norms, q/k's
    norm and rotation, and attention, and silu as torch computes it (x / (1 + exp(-x)), float32; torch's vectorized
    exp may differ in the last bit)."""
    q_heads, kv_heads = heads
    dim = keys.shape[-1]
    h = np.empty((1, len(x)), np.float32)
    jit._norm(x.reshape(1, -1), norms[0], eps[0], h)
    q = np.empty((q_heads, dim), np.float32)
    qkv = _linear(h, tables[0])[0]
    jit._rope(qkv.reshape(-1, dim), qk_weight, cos, sin, eps[2], q_heads, kv_heads, keys, values, n, q)
    attended = np.empty((kv_heads, q_heads // kv_heads, dim), np.float32)
    jit._attend(q.reshape(kv_heads, -1, dim), keys, values, n + 1, scaling, attended)
    x += _linear(attended.reshape(1, -1), tables[1])[0]
    jit._norm(x.reshape(1, -1), norms[1], eps[1], h)
    gate_up = _linear(h, tables[2])[0]
    inner = len(gate_up) // 2
    act = np.empty(inner, np.float32)
    for i in range(inner):
        act[i] = gate_up[i] / (np.float32(1) + np.exp(-gate_up[i])) * gate_up[inner + i]
    x += _linear(act.reshape(1, -1), tables[3])[0]


def _make_block(numba):
    """The intrinsic _block(weights, high, low, in_features, sums): for a block of 64 output channels at address
    weights (in_features / 4 groups of 64 channels x 4 int8 values), the dot products of the uint8 rows high and low
    with each channel, into sums (2 x 64 int32): one vpdpbusd per 64 weights and part, four accumulators a part.
    The block is read as STREAMS runs side by side, each prefetched AHEAD bytes on: one run a core read 21-22 GB/s
    on the 2B's weights, four such 25-27, as fast as the bench's bandwidth probe (docs/quantization.md)."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    lanes = ir.VectorType(i32, 16)

    @intrinsic
    def block(typingctx, weights, high, low, in_features, sums):
        signature = numba.types.void(*[numba.types.int64] * 5)

        def codegen(context, builder, sig, args):
            weights, high, low, in_features, sums = args
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
            read, keep, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
            zero = ir.Constant(lanes, [0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(2)]
            groups = builder.udiv(in_features, ir.Constant(i64, 4 * STREAMS))  # fits(): in_features % 64 == 0
            with cgutils.for_range(builder, groups) as loop:
                for stream in range(STREAMS):
                    group = builder.add(loop.index, builder.mul(groups, ir.Constant(i64, stream)))
                    base = builder.add(weights, builder.mul(group, ir.Constant(i64, 4 * BLOCK)))
                    ws = []
                    for j in range(4):
                        at = builder.add(base, ir.Constant(i64, 64 * j))
                        ahead = builder.inttoptr(builder.add(at, ir.Constant(i64, AHEAD)), i8.as_pointer())
                        builder.call(prefetch, [ahead, read, keep, data])
                        ws.append(builder.load(builder.inttoptr(at, lanes.as_pointer()), align=1))
                    for acc, row in zip(accs, (high, low)):
                        at = builder.add(row, builder.mul(group, ir.Constant(i64, 4)))
                        four = builder.load(builder.inttoptr(at, i32.as_pointer()), align=1)
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
    """Compile the kernels (or load them from numba's cache; jit's must be warm: they call its own) and check the sums
    on a packed weight whose channels do not fill its last block; ready where the CPU has AVX-512 VNNI and the layout
    is as read. False, with one log line, where not."""
    global _block, _sums, _linear, _layer, _decode, _List, prange, ready
    if ready:
        return True
    try:
        import numba
        from llvmlite import binding
        # LLVM aborts the process on an intrinsic its target lacks: ask numba's target, not only the CPU.
        features = numba.config.CPU_FEATURES or binding.get_host_cpu_features().flatten()
        if "+avx512vnni" not in features.split(","):
            raise ValueError("numba's target has no AVX-512 VNNI")
        if not jit.ready.is_set():
            raise ValueError("jit's kernels are not compiled")
        _block, prange = _make_block(numba), numba.prange
        _sums = numba.njit(parallel=True, nogil=True, cache=True)(_sums_kernel)
        _linear, _layer, _decode = map(numba.njit(nogil=True, cache=True),
                                       (_linear_kernel, _layer_kernel, _decode_kernel))
        from numba.typed import List as _List
        generator = torch.Generator().manual_seed(0)
        weights = torch.randint(-127, 128, (BLOCK + 3, 2 * BLOCK), dtype=torch.int8, generator=generator)
        part = torch.ops.onednn.qlinear_prepack(weights, None)
        if not fits(part):
            raise ValueError(f"oneDNN packed a {tuple(weights.shape)} weight in {torch.ops.mkldnn._nbytes(part)} bytes")
        parts = torch.randint(1, 128, (2, 2 * BLOCK), dtype=torch.uint8, generator=generator).numpy()  # high, low
        got = np.empty((1, BLOCK + 3), np.float32)
        addresses, starts, counts, offsets, *_ = Table([part], torch.ones(BLOCK + 3), 1, None, None).args
        _sums(parts, np.ones((1, 1), np.float32), addresses, starts, counts, offsets, np.ones(BLOCK + 3, np.float32),
              got)
        sums = (parts.astype(np.int64) - 64) @ weights.numpy().astype(np.int64).T
        if not np.allclose(got[0], sums[0] + sums[1] / 126, rtol=1e-6):
            raise ValueError("its sums differ from the exact ones")
        _compile_decode()
    except Exception as e:  # no AVX-512 VNNI, or oneDNN lays its weights out otherwise
        log.warning("qvl's decode kernel for oneDNN's weights is unavailable (%s: %s); oneDNN's own call decodes, "
                    "slower", type(e).__name__, e)
        return False
    ready = True
    return True


def _compile_decode():
    """decode() once on two small layers (4 query heads and 2 key/value heads of 16, hidden 64) over a float32 cache
    and a bf16 one, one with a linear that has loud channels, and a 10-token table: the types a decode step passes,
    compiled (and numba's typed list made for them) before it needs them."""
    def table(out_features: int, apart: bool = False) -> Table:
        part = torch.ops.onednn.qlinear_prepack(torch.ones(out_features, 64, dtype=torch.int8), None)
        loud = (torch.tensor([1]), torch.ones(1, out_features)) if apart else (None, None)
        return Table([part], torch.ones(out_features), 1, *loud)

    norm, rows = torch.ones(64), torch.ones(6, 16)
    for dtype in (torch.float32, torch.bfloat16):
        keys, values = torch.zeros(2, 4, 16, dtype=dtype), torch.zeros(2, 4, 16, dtype=dtype)
        prepared = [prepare((norm, norm), (1e-6,) * 3, (4, 2), 0.25, rows, keys, values,
                            (table(128), table(64), table(128), table(64, apart=loud))) for loud in (False, True)]
        decode(3, torch.ones(16), torch.ones(16), 0, layers(prepared),
               ends(torch.ones(10, 64, dtype=torch.bfloat16), norm, 1e-6, table(10)))
