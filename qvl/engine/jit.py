"""The decode step's attention over the KV cache, its norms and rotary embedding, and w8a14's split of a decode row,
as numba kernels: in torch's ops attention goes through MKL's matmuls, whose kernels for one or two rows stream the
cache at half the speed a kernel of its own reaches, and the norms, the rotation and the split are dozens of small
ops a layer whose dispatch costs more than their work (docs/performance.md, "Figures behind the code"). Also a bf16
vision tower's int8 weights converted for an image, in one pass where torch's ops take two.

numba is imported by warm(), at the end of the engine's background work once it serves: its import and a first
compile take seconds (later starts load numba's cache), which a start should not wait for. Until then the decode
step runs on torch's ops, which compute the same numbers within float rounding (tests hold the two together).
"""
import hashlib
import logging
import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("qvl")
ready = threading.Event()  # set once the kernels are compiled; the decode step uses them from then on
_warming = threading.Lock()
# numba's default thread pool aborts the process when two threads launch a parallel kernel at once; one generation
# runs at a time, but two engines in one process need not.
_launch = threading.Lock()
prange = range  # numba.prange once warm() has imported numba: the kernel's loop over heads then runs on every core


def widen(src, bits):
    """In a kernel: a cache row (float32, or bf16 as its uint16 bits) as float32; bits: scratch room for a bf16 row.
    numba picks the body by src's type (_register's overload): one kernel source reads both caches."""


def store(src, dst):
    """In a kernel: dst[:] = src (float32) into a float32 cache row, or rounded to the nearest bf16 (ties to even, as
    torch rounds) into a bf16 one."""


def peak(row):
    """In a kernel: the largest magnitude in a float32 row, kept in 16 running maxima (one is a chain of dependent
    maxima, 4x slower: a split of the 2B's 6144-wide row took 12.2 us against 5.6)."""


def extremes(row):
    """In a kernel: the least and the largest value in a float32 row, each kept in 16 running lanes (as peak's)."""


def dot(row, q):
    """In a kernel: the dot product of a cache row (float32, or bf16 as its uint16 bits) with q (float32), 16 lanes at
    a time (_register's intrinsics)."""


def dot_pair(row, q0, q1):
    """In a kernel: (dot(row, q0), dot(row, q1)), the same sums, reading row once."""


def weighted_pair(w0, w1, rows, n, out0, out1):
    """In a kernel: out0 = w0[:n] @ rows[:n], out1 = w1[:n] @ rows[:n] (rows: cache rows as dot reads them, one a
    position), each value's products added position by position; each 32-value stretch of the outputs summed in
    registers over every position (an output read back and written each position took 2.6x as long), the rows asked
    for AHEAD positions before they are read."""


def prefetch(row):
    """In a kernel: have the core start reading row (a cache row) while it computes another."""


AHEAD = 8  # positions: the cache rows a core asks for before it reads them


def _attend_kernel(q, keys, values, n, scale, out):
    """out[h, g] = softmax(keys[h, :n] @ q[h, g] * scale) @ values[h, :n]; q, out: (kv heads, queries each, head_dim).
    A decode step finds the cache in memory, not in the core's caches: each row is asked for AHEAD positions before it
    is read, and read 16 lanes at a time, once for two query heads (dot_pair, weighted_pair). The 2B's 28 layers over
    1000 cached positions, each layer's cache read after 54 MB of other data, took 8.7 ms against 12.4 without the
    lanes and the prefetch, on an AMX Xeon; over 404, 4.1-4.4 ms against 4.4-4.8 with each query head's row read on its
    own and each output summed in memory (1.9 against 2.4-2.8 where the cache was in the core's caches)."""
    heads, group, _ = q.shape
    for h in prange(heads):
        weights = np.empty((group, n), np.float32)
        for p in range(n):
            prefetch(keys[h, min(p + AHEAD, n - 1)])
            for g in range(0, group, 2):  # query heads in pairs, an odd one paired with itself
                other = min(g + 1, group - 1)
                first, second = dot_pair(keys[h, p], q[h, g], q[h, other])
                weights[g, p], weights[other, p] = first * scale, second * scale
        for g in range(group):
            top = weights[g].max()
            total = np.float32(0)
            for p in range(n):
                e = math.exp(weights[g, p] - top)
                weights[g, p] = e
                total += e
            weights[g] /= total
        for g in range(0, group, 2):
            other = min(g + 1, group - 1)
            weighted_pair(weights[g], weights[other], values[h], n, out[h, g], out[h, other])


def _dequantize_kernel(values, scale, out):
    """out[r] = values[r] * scale[r], int8 values times a row's scale (float32, or bf16 bits), rounded as out is
    stored (store). The product of an int8 and a bf16 is exact in float32, so a bf16 out is torch's own rounding."""
    rows, cols = values.shape
    scales = widen(scale, np.empty(rows, np.uint32))
    for r in prange(rows):
        factor, row = scales[r], np.empty(cols, np.float32)
        for j in range(cols):
            row[j] = np.float32(values[r, j]) * factor
        store(row, out[r])


def _split_kernel(rows, parts, offset):
    """Each row over its level (peak / 63): parts[:r] its whole numbers, parts[r:] what they rounded off times 126,
    rounded, each plus offset (64 for oneDNN's uint8 input, 0 for fbgemm's float one); returns the levels.
    quant.Int8Linear._split in torch's ops."""
    r, n = rows.shape
    levels = np.empty((r, 1), np.float32)
    for i in range(r):
        level = max(peak(rows[i]), np.float32(1.1754944e-38)) / np.float32(63)
        levels[i, 0] = level
        for j in range(n):
            h = rows[i, j] / level
            whole = np.round(h)
            parts[i, j] = whole + offset
            parts[r + i, j] = np.round((h - whole) * np.float32(126)) + offset
    return levels


def _levels_kernel(rows, out):
    """Each row over its peak in 127 levels a side, plus 128: oneDNN's uint8 input for a prompt, a scale per row
    (quant.Int8Linear._per_token in torch's ops, bit for bit: x / peak, times 1 over the float32 scale 1/127, plus
    128 in one rounding, then rounded half to even); returns the peaks."""
    r, n = rows.shape
    peaks = np.empty((r, 1), np.float32)
    inverse = np.float32(1) / np.float32(1 / 127)
    for i in prange(r):
        top = max(peak(rows[i]), np.float32(1.1754944e-38))
        peaks[i, 0] = top
        for j in range(n):  # x / peak * inverse + 128 rounded once (contracted), as torch's quantization computes it
            out[i, j] = np.uint8(np.rint(rows[i, j] / top * inverse + np.float32(128)))
    return peaks


def _tensor_levels_kernel(rows, out, loud):
    """All of rows (float32, or bf16 as its bits) in 256 levels from their least value to their largest (0 within
    them): oneDNN's uint8 input at one scale and zero point for the whole tensor (quant.tensor_levels in torch's ops,
    bit for bit: x times 1 over the float32 scale, plus the zero point, in one rounding, then rounded half to even and
    kept within 0..255); returns the scale and the zero point, or (0, -1) without writing out where the loudest row's
    peak is over `loud` times the median row's (the lower median)."""
    r, n = rows.shape
    lows, highs = np.empty(r, np.float32), np.empty(r, np.float32)
    for i in prange(r):
        lows[i], highs[i] = extremes(widen(rows[i], np.empty(n, np.uint32)))
    peaks = np.sort(np.maximum(-lows, highs))
    if peaks[-1] > loud * peaks[(r - 1) // 2]:
        return np.float32(0), np.int64(-1)
    low, high = min(lows.min(), np.float32(0)), max(highs.max(), np.float32(0))
    level = max((high - low) / np.float32(255), np.float32(1.1754944e-38))  # all zeros: at the zero point
    zero = min(max(np.rint(-low / level), np.float32(0)), np.float32(255))
    inverse = np.float32(1) / level
    for i in prange(r):
        x = widen(rows[i], np.empty(n, np.uint32))
        for j in range(n):
            out[i, j] = np.uint8(min(max(np.rint(x[j] * inverse + zero), np.float32(0)), np.float32(255)))
    return level, np.int64(zero)


def _vision_rope_kernel(qkv, cos, sin, q, k, v):
    """A vision block's q/k/v (qkv: positions x 3 x heads x dim) into the layout attention reads (heads x positions x
    dim each), q and k rotated as transformers rotates them: x * cos + rotate_half(x) * sin in float32, each product
    and the sum rounded once, then stored as q is (store)."""
    positions, _, heads, dim = qkv.shape
    half = dim // 2
    for p in prange(positions):
        bits, y = np.empty(dim, np.uint32), np.empty(dim, np.float32)
        for h in range(heads):
            for part in range(2):
                x = widen(qkv[p, part, h], bits)
                for i in range(half):
                    y[i] = x[i] * cos[p, i] + (-x[i + half]) * sin[p, i]
                for i in range(half, dim):
                    y[i] = x[i] * cos[p, i] + x[i - half] * sin[p, i]
                store(y, q[h, p] if part == 0 else k[h, p])
            v[h, p] = qkv[p, 2, h]


def _join_kernel(y, levels, scale, out):
    """out = (y[:r] + y[r:] / 126) * levels * scale: the two parts' outputs back as one row each, each column times
    its weight row's scale."""
    r = len(out)
    for i in range(r):
        for j in range(out.shape[1]):
            out[i, j] = (y[i, j] + y[r + i, j] * np.float32(1 / 126)) * levels[i, 0] * scale[j]


def rms_norm(x, weight, eps, out):
    """In a kernel: out = x / sqrt(mean(x^2) + eps) * weight for one float32 row, its squares summed 16 lanes at a
    time (dot)."""


def _norm_kernel(x, weight, eps, out):
    """RMSNorm of each row of x: a decode step's few."""
    for r in range(len(x)):
        rms_norm(x[r], weight, eps, out[r])


def _prompt_norm_kernel(x, weight, eps, out):
    """_norm_kernel over every core, for a prompt's rows: transformers' six ops took ~80 ms of the 2B's first token.
    A function of its own: numba's cache keeps one compile a function, and a decode row's stays off the thread pool."""
    for r in prange(len(x)):
        rms_norm(x[r], weight, eps, out[r])


def _rope_kernel(qkv, weight, cos, sin, eps, q_heads, kv_heads, keys, values, n, q):
    """A decode row's q/k/v heads (qkv: heads x dim) into place: each q and k head RMS-normed with its row of weight
    and rotated (y * cos + roll(y, dim / 2) * sin, sin's first half negated), q's into q, k's into keys[:, n], and
    v's into values[:, n]."""
    dim = qkv.shape[1]
    half = dim // 2
    y, rotated = np.empty(dim, np.float32), np.empty(dim, np.float32)
    for h in range(q_heads + kv_heads):
        rms_norm(qkv[h], weight[h], eps, y)
        out = q[h] if h < q_heads else rotated
        for i in range(dim):
            out[i] = y[i] * cos[i] + y[(i + half) % dim] * sin[i]
        if h >= q_heads:
            store(rotated, keys[h - q_heads, n])
    for h in range(kv_heads):
        store(qkv[q_heads + kv_heads + h], values[h, n])


def _prompt_rope_kernel(qkv, weight, eps, cos, sin, q_heads, kv_heads, q, k):
    """A prompt's q and k heads (qkv: positions x heads x dim, q's heads, then k's, then v's) each RMS-normed with its
    row of weight and rotated as transformers rotates them (x * cos + rotate_half(x) * sin, each product and the sum
    rounded once), into q (q heads x positions x dim) and k (kv heads x positions x dim), the layout attention reads."""
    positions, _, dim = qkv.shape
    half = dim // 2
    for p in prange(positions):
        y = np.empty(dim, np.float32)
        for h in range(q_heads + kv_heads):
            rms_norm(qkv[p, h], weight[h], eps, y)
            out = q[h, p] if h < q_heads else k[h - q_heads, p]
            for i in range(half):
                out[i] = y[i] * cos[p, i] + (-y[i + half]) * sin[p, i]
            for i in range(half, dim):
                out[i] = y[i] * cos[p, i] + y[i - half] * sin[p, i]


def _register(numba):
    """widen's and store's bodies for numba, by the element type (bf16 travels as its uint16 bits). Inlined: as calls
    they kept the loops around them from vectorizing (a tower's weight conversions took twice as long). And rms_norm's,
    peak's, extremes', and dot's, dot_pair's, weighted_pair's and prefetch's (_rows)."""
    from numba.extending import overload
    _rows(numba)

    @overload(widen, inline="always")
    def _widen(src, bits):
        if src.dtype == numba.types.uint16:
            def from_bf16(src, bits):
                for d in range(len(src)):
                    bits[d] = np.uint32(src[d]) << 16
                return bits.view(np.float32)
            return from_bf16
        return lambda src, bits: src

    @overload(store, inline="always")
    def _store(src, dst):
        if dst.dtype == numba.types.uint16:
            def to_bf16(src, dst):
                bits = src.view(np.uint32)
                for i in range(len(src)):
                    dst[i] = (bits[i] + np.uint32(0x7FFF) + ((bits[i] >> 16) & np.uint32(1))) >> 16
            return to_bf16

        def as_is(src, dst):
            dst[:] = src
        return as_is

    @overload(rms_norm, inline="always")
    def _rms_norm(x, weight, eps, out):
        def one_row(x, weight, eps, out):
            inv = np.float32(1 / math.sqrt(dot(x, x) / len(x) + eps))
            for i in range(len(x)):
                out[i] = x[i] * inv * weight[i]
        return one_row

    @overload(peak, inline="always")
    def _peak(row):
        def in_lanes(row):
            n = len(row)
            whole = n - n % 16
            lanes = np.zeros(16, np.float32)
            for j in range(0, whole, 16):
                for lane in range(16):
                    lanes[lane] = max(lanes[lane], abs(row[j + lane]))
            top = lanes.max()
            for j in range(whole, n):
                top = max(top, abs(row[j]))
            return top
        return in_lanes

    @overload(extremes, inline="always")
    def _extremes(row):
        def in_lanes(row):
            n = len(row)
            whole = n - n % 16
            lows, highs = np.full(16, np.inf, np.float32), np.full(16, -np.inf, np.float32)
            for j in range(0, whole, 16):
                for lane in range(16):
                    lows[lane] = min(lows[lane], row[j + lane])
                    highs[lane] = max(highs[lane], row[j + lane])
            low, high = lows.min(), highs.max()
            for j in range(whole, n):
                low, high = min(low, row[j]), max(high, row[j])
            return low, high
        return in_lanes


def _rows(numba):
    """dot, dot_pair, weighted_pair and prefetch as numba intrinsics in LLVM's own vectors of 16 float32 lanes, which
    every target has (one AVX-512 register, two AVX2, four NEON): numba's own loops over a row vectorized it 8 lanes at
    a time at best, around scalar work."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.extending import intrinsic, overload

    f32, i32, i64, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.IntType(8)
    # weighted_pair's stretch in vectors of 16: its two outputs' 4 sums take 8 of AVX2's 16 registers and 16 of NEON's
    # 32; with 4, AVX2 spilled (10.1 ns a position of a 128-value bf16 row against 7.7-8.6; AVX-512 6.2 against 7.0).
    STRETCH = 2
    lanes = ir.VectorType(f32, 16)

    def rows(*types):
        """At typing: each argument a contiguous row, of cache values (float32 or bf16 bits) or float32 ones."""
        for ty in types:
            if not (isinstance(ty, numba.types.Array) and ty.ndim == 1 and ty.layout == "C"
                    and ty.dtype in (numba.types.float32, numba.types.uint16)):
                raise TypingError(f"a contiguous row of float32 or bf16 bits, not {ty}")

    def row_of(context, builder, ty, value):
        """A row's data pointer and length."""
        array = context.make_array(ty)(context, builder, value)
        return array.data, builder.extract_value(array.shape, 0)

    def load(builder, ty, data, at, kind):
        """kind (lanes, or f32 for one) from data[at:], widened from bf16 bits where ty holds them."""
        if ty.dtype == numba.types.uint16:
            count = kind.count if isinstance(kind, ir.VectorType) else None
            bits = ir.VectorType(ir.IntType(16), count) if count else ir.IntType(16)
            wide = ir.VectorType(i32, count) if count else i32
            raw = builder.load(builder.bitcast(builder.gep(data, [at]), bits.as_pointer()), align=2)
            shift = ir.Constant(wide, [16] * count if count else 16)
            return builder.bitcast(builder.shl(builder.zext(raw, wide), shift), kind)
        return builder.load(builder.bitcast(builder.gep(data, [at]), kind.as_pointer()), align=4)

    def fma(builder, a, b, c):
        name = "llvm.fmuladd.v16f32" if a.type == lanes else "llvm.fmuladd.f32"
        return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name),
                            [a, b, c])

    def spread(builder, value, kind):
        """value in every lane of kind (or itself, for one)."""
        if kind != lanes:
            return value
        first = builder.insert_element(ir.Constant(lanes, None), value, ir.Constant(i32, 0))
        return builder.shuffle_vector(first, ir.Constant(lanes, None), ir.Constant(ir.VectorType(i32, 16), [0] * 16))

    def ask_for(builder, data, size):
        """Have the core start reading size bytes from data, a cache line at a time."""
        start = builder.bitcast(data, i8.as_pointer())
        read = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), size, ir.Constant(i64, 64)) as (at, _):
            builder.call(read, [builder.gep(start, [at]), *(ir.Constant(i32, c) for c in (0, 3, 1))])

    def over(builder, n, body):
        """body(at, kind) over 0..n: 16 lanes at a time, then one at a time."""
        whole = builder.and_(n, ir.Constant(i64, -16))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, ir.Constant(i64, 16)) as (at, _):
            body(at, lanes)
        with cgutils.for_range_slice(builder, whole, n, ir.Constant(i64, 1)) as (at, _):
            body(at, f32)

    def sums(context, builder, sig, args):
        """The dot products of a row (args[0]) with each of the rows after it, as dot computes one."""
        (data, n), *qs = (row_of(context, builder, t, v) for t, v in zip(sig.args, args))
        totals = [{kind: cgutils.alloca_once_value(builder, ir.Constant(kind, [0.0] * 16 if kind == lanes else 0.0))
                   for kind in (lanes, f32)} for _ in qs]

        def body(at, kind):
            x = load(builder, sig.args[0], data, at, kind)
            for (q_data, _), total, ty in zip(qs, totals, sig.args[1:]):
                builder.store(fma(builder, x, load(builder, ty, q_data, at, kind), builder.load(total[kind])),
                              total[kind])
        over(builder, n, body)
        out = []
        for total in totals:
            vector, width = builder.load(total[lanes]), 16
            while width > 1:  # halves added in turn
                width //= 2
                vector = builder.fadd(*(builder.shuffle_vector(vector, vector, ir.Constant(
                    ir.VectorType(i32, width), list(range(k, k + width)))) for k in (0, width)))
            out.append(builder.fadd(builder.extract_element(vector, ir.Constant(i32, 0)), builder.load(total[f32])))
        return out

    @intrinsic
    def dot_rows(typingctx, row, q):
        rows(row, q)
        return numba.types.float32(row, q), lambda context, builder, sig, args: sums(context, builder, sig, args)[0]

    @intrinsic
    def dot_pair_rows(typingctx, row, q0, q1):
        rows(row, q0, q1)
        pair = numba.types.UniTuple(numba.types.float32, 2)

        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, pair, sums(context, builder, sig, args))
        return pair(row, q0, q1), codegen

    @intrinsic
    def weighted_pair_rows(typingctx, w0, w1, table, n, out0, out1):
        rows(w0, w1, out0, out1)
        if any(ty.dtype != numba.types.float32 for ty in (w0, w1, out0, out1)):
            raise TypingError("float32 weights and outputs")
        if not (isinstance(table, numba.types.Array) and table.ndim == 2 and table.layout == "C"
                and table.dtype in (numba.types.float32, numba.types.uint16)):
            raise TypingError(f"contiguous rows of float32 or bf16 bits, not {table}")

        def codegen(context, builder, sig, args):
            w0, w1, out0, out1 = (row_of(context, builder, sig.args[i], args[i])[0] for i in (0, 1, 4, 5))
            array = context.make_array(sig.args[2])(context, builder, args[2])
            data, width, n = array.data, builder.extract_value(array.shape, 1), args[3]
            row_bytes = builder.mul(width, ir.Constant(i64, sig.args[2].dtype.bitwidth // 8))
            last = builder.sub(n, ir.Constant(i64, 1))

            def stretches(start, stop, vectors, kind, ask):
                """Each stretch of vectors x kind over start..stop, summed over the n positions in registers; ask:
                the stretch at 0 asks for each whole row AHEAD positions on."""
                step = ir.Constant(i64, 16 * vectors if kind == lanes else 1)
                with cgutils.for_range_slice(builder, start, stop, step) as (at, _):
                    totals = [[cgutils.alloca_once_value(builder, ir.Constant(kind, [0.0] * 16 if kind == lanes
                                                                               else 0.0))
                               for _ in range(vectors)] for _ in range(2)]
                    with cgutils.for_range(builder, n) as loop:
                        p = loop.index
                        if ask:
                            with builder.if_then(builder.icmp_unsigned("==", at, ir.Constant(i64, 0))):
                                ahead = builder.add(p, ir.Constant(i64, AHEAD))
                                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)
                                ask_for(builder, builder.gep(data, [builder.mul(ahead, width)]), row_bytes)
                        weights = [spread(builder, builder.load(builder.gep(w, [p])), kind) for w in (w0, w1)]
                        base = builder.add(builder.mul(p, width), at)
                        for v in range(vectors):
                            x = load(builder, sig.args[2], data, builder.add(base, ir.Constant(i64, 16 * v)), kind)
                            for weight, total in zip(weights, totals):
                                builder.store(fma(builder, weight, x, builder.load(total[v])), total[v])
                    for out, total in zip((out0, out1), totals):
                        for v in range(vectors):
                            target = builder.gep(out, [builder.add(at, ir.Constant(i64, 16 * v))])
                            builder.store(builder.load(total[v]), builder.bitcast(target, kind.as_pointer()), align=4)

            wide, whole = (builder.and_(width, ir.Constant(i64, -16 * size)) for size in (STRETCH, 1))
            stretches(ir.Constant(i64, 0), wide, STRETCH, lanes, True)
            stretches(wide, whole, 1, lanes, False)
            stretches(whole, width, 1, f32, False)
            return context.get_dummy_value()
        return numba.types.void(w0, w1, table, n, out0, out1), codegen

    @intrinsic
    def prefetch_row(typingctx, row):
        rows(row)

        def codegen(context, builder, sig, args):
            data, n = row_of(context, builder, sig.args[0], args[0])
            ask_for(builder, data, builder.mul(n, ir.Constant(i64, sig.args[0].dtype.bitwidth // 8)))
            return context.get_dummy_value()
        return numba.types.void(row), codegen

    @overload(dot, inline="always")
    def _dot(row, q):
        return lambda row, q: dot_rows(row, q)

    @overload(dot_pair, inline="always")
    def _dot_pair(row, q0, q1):
        return lambda row, q0, q1: dot_pair_rows(row, q0, q1)

    @overload(weighted_pair, inline="always")
    def _weighted_pair(w0, w1, rows, n, out0, out1):
        return lambda w0, w1, rows, n, out0, out1: weighted_pair_rows(w0, w1, rows, n, out0, out1)

    @overload(prefetch, inline="always")
    def _prefetch(row):
        return lambda row: prefetch_row(row)


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as numpy holds it: as it is, or a bf16 one as its uint16 bits (numpy has no bfloat16)."""
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


# The compiled kernels, and numba's thread count for this thread.
_attend = _dequantize = _levels = _tensor_levels = _vision_rope = None
_split = _join = _norm = _prompt_norm = _rope = _prompt_rope = None
_set_threads = None
_max_threads = 1


def warm(cache_dir: str) -> bool:
    """Import numba and compile the kernels (or load them from numba's cache in cache_dir/numba, unless
    NUMBA_CACHE_DIR says where), then set ready; False, with one log line, where numba cannot be imported or compile
    (torch's ops go on serving)."""
    global prange, _attend, _dequantize, _levels, _tensor_levels, _vision_rope, _split, _join, _norm, _prompt_norm
    global _rope, _prompt_rope
    global _set_threads, _max_threads
    with _warming:
        if _attend is None:
            start = time.perf_counter()
            try:
                import numba
                numba.config.CACHE_DIR = numba.config.CACHE_DIR or os.path.join(cache_dir, "numba", _sources())
                prange, _set_threads = numba.prange, numba.set_num_threads
                _max_threads = numba.config.NUMBA_NUM_THREADS
                _register(numba)
                # reassoc: the dot products and sums vectorize (torch's order is another one); the split stays exact.
                attend = numba.njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})
                kernels = attend(_attend_kernel), *map(numba.njit(nogil=True, cache=True),
                                                       (_split_kernel, _join_kernel, _norm_kernel, _rope_kernel))
                # A prompt's: exact, and over every core (each row, or position, on its own).
                dequantize, vision_rope, prompt_norm, prompt_rope = map(
                    numba.njit(parallel=True, nogil=True, cache=True),
                    (_dequantize_kernel, _vision_rope_kernel, _prompt_norm_kernel, _prompt_rope_kernel))
                # contract: x / peak * inverse + 128 in one rounding, as torch's (fbgemm's) quantization does it.
                in_levels, tensor_levels = map(numba.njit(parallel=True, nogil=True, cache=True,
                                                          fastmath={"contract", "nnan", "ninf", "nsz"}),
                                               (_levels_kernel, _tensor_levels_kernel))
                dequantize(np.ones((2, 2), np.int8), np.ones(2, np.uint16), np.zeros((2, 2), np.uint16))
                in_levels(np.ones((2, 2), np.float32), np.zeros((2, 2), np.uint8))
                tensor_levels(np.ones((2, 2), np.uint16), np.zeros((2, 2), np.uint8), np.float32(4))  # a bf16 tower's
                for dtype in (np.float32, np.uint16):  # an fp32 tower's, a bf16 one's
                    out = np.zeros((1, 1, 2), dtype)
                    vision_rope(np.zeros((1, 3, 1, 2), dtype), np.ones((1, 2), np.float32), np.ones((1, 2), np.float32),
                                out, out.copy(), out.copy())
                q, rows = np.zeros((1, 1, 2), np.float32), np.ones((3, 2), np.float32)
                caches = np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.uint16)  # float32 and bf16
                for cache in caches:
                    kernels[0](q, cache, cache, 1, 1.0, q.copy())
                    kernels[4](rows, rows, rows[0], rows[0], 1e-6, 1, 1, cache, cache.copy(), 1, q[0])
                levels = kernels[1](rows[:1], np.zeros((2, 2), np.float32), np.float32(0))
                kernels[1](rows[:1], np.zeros((2, 2), np.uint8), np.float32(64))  # oneDNN's parts
                kernels[2](rows[:2], levels, rows[0], np.zeros((1, 2), np.float32))
                kernels[3](rows, rows[0], 1e-6, rows.copy())
                prompt_norm(rows, rows[0], 1e-6, rows.copy())
                prompt_rope(np.ones((1, 3, 2), np.float32), rows, 1e-6, rows, rows, 1, 1, q.copy(), q.copy())
            except Exception as e:  # no numba wheel for this platform, or a compile failure
                log.warning("the numba decode kernels are unavailable (%s: %s); decoding with torch's ops",
                            type(e).__name__, e)
                return False
            (_attend, _split, _join, _norm, _rope), _dequantize = kernels, dequantize
            _levels, _vision_rope, _prompt_norm, _prompt_rope = in_levels, vision_rope, prompt_norm, prompt_rope
            _tensor_levels = tensor_levels
            log.info("the numba decode kernels are ready (%.1f s; cached in %s)", time.perf_counter() - start,
                     numba.config.CACHE_DIR)
        ready.set()
        return True


def _sources() -> str:
    """A digest of the kernels' sources: numba checks a cached kernel against its own file only, and vnni's kernels
    call these, so a kernel changed here must not be loaded from its cache inside one of vnni's."""
    digest = hashlib.sha256()
    for name in ("jit.py", "vnni.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:12]


def _engine_threads():
    """Under _launch: numba's thread count for this thread (numba keeps one per thread) set to the engine's."""
    _set_threads(min(torch.get_num_threads(), _max_threads))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """Attention of q (kv heads x queries each x head_dim) over the first n positions of the buffers keys and values
    (kv heads x room x head_dim, float32 or bf16); the output has q's shape."""
    q = q.contiguous()
    out = torch.empty_like(q)
    with _launch:
        _engine_threads()
        _attend(q.numpy(), _array(keys), _array(values), n, scale, out.numpy())
    return out


def dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values.to(bfloat16) * scale[:, None] for int8 values and a bf16 scale per row, bit for bit, in one pass: a bf16
    vision tower converts its int8 weights for each image, and torch's two ops took twice as long."""
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    with _launch:
        _engine_threads()
        _dequantize(values.numpy(), _array(scale), _array(out))
    return out


def levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_levels_kernel: x's rows (float32) as oneDNN's uint8 input at scale 1/127 and zero point 128, each over its own
    peak, and the peaks (x's shape with 1 last). torch's five ops took 1.55 ms to make them for a 404-row input of the
    2B's down projection, the kernel 0.56."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.uint8)
    with _launch:
        _engine_threads()
        peaks = _levels(rows.numpy(), out.numpy())
    return out.view(x.shape), torch.from_numpy(peaks).view(*x.shape[:-1], 1)


def tensor_levels(x: torch.Tensor, loud: float) -> tuple[torch.Tensor, float, int] | None:
    """_tensor_levels_kernel: x's rows (bf16) as oneDNN's uint8 input at one scale and zero point, and those two; None
    where a row is over `loud` times as loud as the median one."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.uint8)
    with _launch:
        _engine_threads()
        level, zero = _tensor_levels(_array(rows), out.numpy(), np.float32(loud))
    return None if zero < 0 else (out.view(x.shape), float(level), int(zero))


def vision_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """_vision_rope_kernel: a vision block's q, k and v (1 x heads x positions x dim each, qkv's dtype) from its qkv
    output (positions x 3 x heads x dim), q and k rotated; transformers' rotation is ~14 torch ops a block, 3.5-8 ms
    for the 2B's 1200 patches in bf16, the kernel 1.2."""
    positions, _, heads, dim = qkv.shape
    q, k, v = torch.empty(3, 1, heads, positions, dim, dtype=qkv.dtype)
    with _launch:
        _engine_threads()
        _vision_rope(_array(qkv.contiguous()), cos.float().contiguous().numpy(), sin.float().contiguous().numpy(),
                     *(_array(t[0]) for t in (q, k, v)))
    return q, k, v


def prompt_rope(qkv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """_prompt_rope_kernel: a prompt's q and k (1 x heads x positions x dim each) from its q/k/v linear's output (1 x
    positions x q, k and v heads of heads[i] each, float32), weight as rope() takes it, cos and sin transformers' (1 x
    positions x dim): its norms, transposes and ~8 rotation ops a layer took ~50 ms of the 2B's first token."""
    positions, dim = qkv.shape[1], cos.shape[-1]
    q, k = torch.empty(1, heads[0], positions, dim), torch.empty(1, heads[1], positions, dim)
    with _launch:
        _engine_threads()
        _prompt_rope(qkv.contiguous().view(positions, -1, dim).numpy(), weight.detach().view(-1, dim).numpy(), eps,
                     cos.reshape(positions, dim).contiguous().numpy(), sin.reshape(positions, dim).contiguous().numpy(),
                     heads[0], heads[1], q[0].numpy(), k[0].numpy())
    return q, k


def in_two_parts(rows: torch.Tensor, linear, scale: torch.Tensor, uint8: bool) -> torch.Tensor:
    """quant.Int8Linear._two_part: rows (r x in, float32, contiguous) split into 2r whole-number rows (uint8: plus
    64, as oneDNN's kernel takes them, else float32), linear's output for them (r x out, before the weight rows'
    scales), joined back into r rows times scale. numpy's buffers: a decode step makes this call ~113 times, and each
    torch op around it cost more than the kernels."""
    parts = np.empty((2 * len(rows), rows.shape[1]), np.uint8 if uint8 else np.float32)
    levels = _split(rows.numpy(), parts, np.float32(64 if uint8 else 0))
    y = linear(torch.from_numpy(parts))
    out = np.empty((len(rows), y.shape[1]), np.float32)
    _join(y.numpy(), levels, scale.numpy(), out)
    return torch.from_numpy(out)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, weight.shape, weight, eps) for a float32 x and weight: a decode row on the calling core, more rows
    (a prompt's) over every core."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, outs = x.view(-1, x.shape[-1]).numpy(), out.view(-1, x.shape[-1]).numpy()
    if len(rows) == 1:
        _norm(rows, weight.detach().numpy(), eps, outs)
        return out
    with _launch:
        _engine_threads()
        _prompt_norm(rows, weight.detach().numpy(), eps, outs)
    return out


def rope(qkv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
         heads: list[int], keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """_rope_kernel: a decode row's q/k/v (q, k and v heads of heads[i] each, x head_dim, in one row) normed, rotated
    and its k and v written at position n of keys and values (kv heads x room x head_dim); returns q (q heads x
    head_dim)."""
    dim = keys.shape[-1]
    q = torch.empty(heads[0], dim)
    _rope(qkv.contiguous().view(-1, dim).numpy(), weight.detach().view(-1, dim).numpy(), cos.reshape(-1).numpy(),
          sin.reshape(-1).numpy(), eps, heads[0], heads[1], _array(keys), _array(values), n, q.numpy())
    return q
