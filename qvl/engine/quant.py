"""Loading the model in the precision and quantization that is fastest on this CPU.

Measured on a quiet 2-core AVX2 EPYC (no AVX-512), one 2048x6144 linear, weights out of cache (`python -m qvl.bench`
has the whole-model figures): decode (1 row) fp32 4.8 ms, bf16 2.3, fbgemm dynamic int8 0.80, int8 weight-only 1.5,
int4 weight-only (group 128) 1.1; prefill (256 rows) fbgemm int8 216 GFLOP/s, fp32 78, int8/int4 weight-only ~46,
bf16 19 (no bf16 instructions: bf16 matmuls are emulated). So on AVX2 fbgemm int8 wins both phases.

`auto` is `w8a14` wherever fbgemm's kernel is bound by reading the weights: with AVX-512 VNNI (Zen 4/5, Ice Lake,
Sapphire Rapids), and with AVX2 on cores that run 256-bit operations whole (Zen 2 and later, Intel's big cores). It
is the same fbgemm int8 linears, each text decode row fed as two rows (its int8 levels and what they rounded off, 14
bits together, Int8Linear._two_part), and reading each weight once serves both rows, so the second row costs only
the split's elementwise work; and the first text layers' weights in two int8 parts (TWO_PART_LAYERS), whose errors
every later layer carries on. Measured on a 2-core Zen 4 (`python -m qvl.bench --random-weights [--outliers]
--rows fp32,bf16,int8,w8a16,auto --runs 1`, README's Speed section): the logits of `w8a16` (int8 weights, bf16
activations never quantized; 22.2/22.8 dB of SQNR against `int8`'s 17.4/18.4, plain/outliers) within 0.7 dB, a decode
1.3x `w8a16`'s (whose weight-only kernel reads bytes slower) and 0.91-0.95x `int8`'s (one process, the two
alternating), and `int8`'s first token, 0.65-0.8x `w8a16`'s. On a Zen 3 (AVX2 only): fbgemm's call takes as long
for two rows as for one at every shape of the 2B, and a standard answer decoded at 0.90-0.98x `int8`'s speed (median
0.949, five alternating pairs in one process) for 21.4 dB against 17.4. Where cores split 256-bit operations in
two (Zen 1, cpu.halves_256_bit) the kernel is bound by computing (a Zen 1 core reads ~9 GB/s through it), the second
row cost ~29% (a scratch measurement of an earlier version), and `auto` is `int8`. int4 (an int4 copy of each text
linear for decode, an fbgemm int8 one for prefill) decodes ~1.8x as fast on a Zen 5 but its g128 weights keep 2 dB
(`--linears`), and the two copies hold 0.38x fp32's memory. All stay available by name.

The quantized modes stream the checkpoint tensor by tensor into an uninitialised skeleton and
convert each linear as it arrives, so loading never holds a full bf16 copy beside the quantized one (2B int8: 3.3 GB
peak at load instead of 8.9 GB).

transformers (and qvl.engine.lean, built on it) is imported where a model is built, not at the top: the model cache's
read-ahead imports this module for its linears, to pack stored weights while transformers is still importing.
"""
import collections
import contextvars
import functools
import json
import logging
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from qvl.engine import cpu, heap, jit

log = logging.getLogger("qvl")

GROUP = 128  # int4 scale/zero group: 32 gains little accuracy on these weights and decodes 40% slower
EMBEDDING = "model.language_model.embed_tokens"  # the token table, kept as a Bf16Embedding
DECODE_ROWS = 8  # up to this many rows the int4 kernel is bandwidth-bound and wins; above, int8 compute wins
# Set while a prompt is prefilled: int4 then takes its int8 twin however few the rows, so that the part of a prompt
# left after a kept prefix (Regenerate's one token) is computed on the weights a whole prompt's tokens are. w8a14's
# few-row split stays: it is nearer fp32 than a prompt's rows, and conversation memory only has to be no farther.
prompting = contextvars.ContextVar("prompting", default=False)
# Modes whose decode steps read other weights than their prompts (int4's prompts run on int8 twins): a position they
# decoded is not what a prompt computes there, so conversation memory keeps only what their prompts computed.
PROMPT_TWINS = frozenset({"int4"})
# w8a14 keeps the first text layers' weights in two int8 parts (Int8Linear), ~15 bits a weight: an error there runs
# through every layer after it. The random 2B's text logits with w8a14's decode (scratch sens2.py, Zen 3, 2026-12-04,
# plain / outlier weights): 21.3 / 21.3 dB of SQNR against fp32 with none, 26.5 / 26.6 with layer 0, 28.3 / 28.4
# with layers 0-1, 29.4 / 29.6 with 0-2, where `--linears` had bf16 at 33.1 / 33.0; each layer adds 2.9% to a
# decode step's bytes. Keeping the head or the last layer so gained under 0.2 dB, and `int8`, whose 7-bit
# activations cost it more than its weights, 0.35 dB (12.4 -> 12.8, layers 0-1), so it keeps one part.
TWO_PART_LAYERS = 2


def resolve(mode: str, flags: frozenset[str] | None = None, halves: bool | None = None) -> str:
    """The concrete mode `auto` stands for on a CPU with these instruction sets and whose cores do (halves) or do not
    split 256-bit operations in two (default: this CPU's)."""
    if mode != "auto":
        return mode
    flags = cpu.flags() if flags is None else flags
    halves = cpu.halves_256_bit() if halves is None else halves
    # Where fbgemm's kernel is bound by reading the weights it reads a second row nearly free: w8a16's quality near
    # int8's speed (module docstring).
    if "VNNI" in flags or ("AVX2" in flags and not halves):
        return "w8a14"
    # fbgemm needs AVX2; without it, it and the int4 kernel fall back to scalar loops slower than fp32.
    return "int8" if "AVX2" in flags else "fp32"


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with these instruction sets (default: this CPU's) computes bf16 dot products in hardware; without
    them bf16 matmuls are emulated, several times slower than fbgemm's int8."""
    return bool((cpu.flags() if flags is None else flags) & {"BF16", "AMX"})


class Bf16Embedding(nn.Module):
    """The token table in bf16 (a gather reads one row per token, so precision costs nothing in speed)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))  # a buffer: model.dtype stays fp32

    def forward(self, ids):
        return F.embedding(ids, self.weight).float()


class Int4Linear(nn.Module):
    """Weight-only int4 (asymmetric, groups of GROUP) with bf16 activations; an optional fbgemm int8 twin for prefill.

    Built from its stored tensors (the model cache) or by quantize() from a float linear.
    """

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, bias, out_features: int, prefill):
        super().__init__()
        self.out_features, self.in_features = out_features, packed.shape[1] * 2  # two 4-bit values a byte
        self.group = self.in_features // scale_zero.shape[0]
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.prefill = prefill

    @classmethod
    def quantize(cls, linear: nn.Linear, prefill: bool) -> "Int4Linear":
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        group = min(GROUP, in_features)  # the tiny test model's layers are narrower than a group
        # The kernel packs rows in blocks of 16: pad with zero rows (the tiny model's 270-token vocabulary).
        w = F.pad(w, (0, 0, 0, -out_features % 16))
        groups = w.reshape(w.shape[0], -1, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(w.shape)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel dequantizes as (q - 8) * scale + zero, so the zero point is the value of q = 8.
        zero = low + 8 * scale
        scale_zero = torch.stack([scale, zero], -1).squeeze(2).transpose(0, 1).contiguous().bfloat16()
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(packed, scale_zero, bias, out_features, _dynamic_int8(linear) if prefill else None)

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        if self.prefill is not None and (flat.shape[0] > DECODE_ROWS or prompting.get()):
            return self.prefill(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.bfloat16(), self.packed, self.group, self.scale_zero).to(x.dtype)
        y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _int8_rows(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32):
    """w's symmetric int8 values and per-row scales (a row's peak is 127 levels), the scales rounded to scale_dtype
    before dividing by them, as the kernel that reads them will.

    Slices of ~1M values (4 MB in fp32), which stay in the CPU's caches between the passes over them, divided and
    rounded in place, without a clamp (a row's peak over its scale rounds to 127 at most, a bf16-rounded scale
    included: it is at most 2^-8 below the exact one): one 12288x2048 weight, one thread, Zen 1, 4 ns a value against
    14 with 4096-row slices and out-of-place ops, which was more than fbgemm packing the weight takes.
    """
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    q = torch.empty(w.shape, dtype=torch.int8)
    step = max(1, (1 << 20) // w.shape[1])
    for i in range(0, w.shape[0], step):
        rows = w[i:i + step].to(torch.float32, copy=True)  # a copy even of fp32 weights: divided in place below
        rows_scale = rows.abs().amax(1).clamp_(min=1e-8).div_(127).to(scale_dtype).float()
        scale[i:i + step] = rows_scale
        q[i:i + step] = rows.div_(rows_scale[:, None]).round_()
    return q, scale


def _dynamic_int8(linear: nn.Linear, parts: int = 1) -> nn.Module:
    """fbgemm dynamic int8 (symmetric per-channel weights, activations quantized as they come, a scale per token);
    parts=2: each weight row as two int8 rows (Int8Linear).

    Quantized straight from bf16 in slices of rows: from_float() would first make an fp32 copy, 1.2 GB for the head.
    """
    q, scale = _int8_rows(linear.weight.detach())
    if parts == 2:
        q_off, scale_off = _int8_rows(linear.weight.detach().float() - q * scale[:, None])
        q, scale = torch.cat([q, q_off]), torch.cat([scale, scale_off])
    # In pieces, which fbgemm packs 2-2.5x faster per value; the engine settles them once it serves.
    return Int8Linear(q, scale, None if linear.bias is None else linear.bias.detach().float(),
                      rows=max(1, PIECE // q.shape[1]), parts=parts)


# torch 2.13 deprecates quantized dtypes (pytorch#184982), which fbgemm's linear still takes, and says so at every
# start; the README says what replaces them when they go. Set once here: catch_warnings is not safe in the threads
# that convert linears side by side.
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")


def at_scale_one(values: torch.Tensor) -> torch.Tensor:
    """int8 values as the torch.qint8 tensor (scale 1, zero point 0) that fbgemm packs, over their own memory: torch's
    _make_*_quantized_tensor functions copy them (the per-channel one 0.4-0.9 ns a value on the Zen 4, 1-2 s of a start
    of the 2B, whose fbgemm linears hold 2.1 B of them), and fbgemm copies them again to pack."""
    weight = torch._empty_affine_quantized(values.shape, scale=1.0, zero_point=0, dtype=torch.qint8)
    return weight.set_(values.untyped_storage(), values.storage_offset(), values.shape, values.stride())


# fbgemm packs a weight of up to ~4M values 2-2.5x faster per value than a larger one (its column-by-column copy
# misses the TLB less), but each piece is one more call per step: every start (converting, or reading the model
# cache) packs pieces of PIECE values, and the engine then repacks them in the background into pieces of up to
# SETTLED_ROWS rows (every decoder linear whole, the 151,936-row head in ten, so that no single repack takes more than
# about a second).
PIECE = 4 << 20
SETTLED_ROWS = 16384


class _Apart(nn.Module):
    """A linear that computes a few loud input channels apart (set_loud_channels_apart finds them): out of its int8
    path, and added back in fp32 against the checkpoint's own weights for them (`columns`, [channels, out_features])."""

    def __init__(self):
        super().__init__()
        self.register_buffer("apart", None)  # buffers: the model cache keeps them with the module's other tensors
        self.register_buffer("columns", None)

    def set_apart(self, channels: torch.Tensor, columns: torch.Tensor):
        """Compute these input channels (int64, ascending) apart, against columns."""
        self.apart, self.columns = channels, columns.float().contiguous()

    def _add_apart(self, y: torch.Tensor, loud: torch.Tensor) -> torch.Tensor:
        return y.view(-1, self.out_features).addmm_(loud.reshape(-1, len(self.apart)), self.columns).view(y.shape)


class Int8Linear(_Apart):
    """fbgemm's dynamic int8 linear with a scale per row: its int8 weight is packed into fbgemm's layout (whole, or in
    pieces of `rows` rows) and each row's scale multiplies the output, and fbgemm quantizes each call's input with one
    scale (7 bits: fbgemm's AVX2 kernel needs the headroom).

    One scale for a whole prompt is set by its loudest token, which leaves the quiet ones few levels: each row is
    brought to the same peak before the call and its output scaled back, which gives every token a scale of its own
    for four elementwise ops (~1% of a prefill). A single row (every decode step) has its own scale already and takes
    fbgemm's call unchanged. On the random 2B's text (300 tokens teacher-forced against fp32) this lifts the logits
    from 7.2 to 12.4 dB of SQNR. Pieces change no output bit: every piece quantizes the same input with the same
    scale, and each output channel is computed on its own.

    A scale per token cannot help where a few channels of every token are 20-100x the rest, as in real checkpoints:
    those channels (found by set_loud_channels_apart when the checkpoint is converted) are zeroed in fbgemm's input
    and their part of the output added back in fp32 against the checkpoint's weights (LLM.int8()'s split, with the
    channels fixed in advance: no search per call). Three small ops a call, in linears that have any.

    `w8a14` (two_part) feeds each decode row as two rows, whose 7 bits each make 14 (_two_part).

    parts=2 holds each weight row as two int8 rows: its levels, then what they rounded off in levels of its own (the
    first text layers', TWO_PART_LAYERS). One fbgemm call reads both, and the output is their sum.
    """

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None,
                 pack=map, parts: int = 1):
        """values: the int8 weight (out x in; with parts=2, the rows' levels and then what they rounded off: 2 out x
        in), scale: each of its rows'. pack: map, or a pool's map to pack the pieces side by side."""
        super().__init__()
        stored, self.in_features = values.shape
        self.out_features, self.weight_parts = stored // parts, parts
        self.rows = min(rows or stored, stored)  # in each loaded piece (the last may have fewer)
        # Packed at scale 1, without the bias: the rows' scales and the bias are applied to fbgemm's output.
        self.parts = list(pack(_pack, [values[i:i + self.rows] for i in range(0, stored, self.rows)]))
        self.register_buffer("scale", scale.float().contiguous())  # float32: what fbgemm's own per-row scales are
        self.merged = 0  # leading parts that settle() has made, or found, final
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.two_part = False  # w8a14 (in_two_parts): each input row fed as two, for 14 bits instead of 7

    def weight(self) -> torch.Tensor:
        """The per-channel torch.qint8 weight as stored (with parts=2, both parts' rows; a copy)."""
        return torch._make_per_channel_quantized_tensor(torch.cat(list(self.pieces())), self.scale.double(),
                                                        torch.zeros(len(self.scale), dtype=torch.long), 0)

    def pieces(self):
        """The int8 values a piece at a time, unpacked as asked for (copies), their rows in order."""
        return (_values(part) for part in self.parts)

    def settle(self, rows: int = SETTLED_ROWS) -> bool:
        """Repack the next run of loaded pieces that fits in `rows` rows as one piece; False once none is left."""
        run = max(1, rows // self.rows)
        while self.merged < len(self.parts):
            start, self.merged = self.merged, self.merged + 1
            group = self.parts[start:start + run]
            if len(group) > 1:
                merged = _pack(torch.cat([_values(part) for part in group]))
                # One assignment: a call in flight keeps the list it read, which computes the same numbers.
                self.parts = [*self.parts[:start], merged, *self.parts[start + run:]]
                return True
        return False

    def forward(self, x):
        if self.apart is not None:
            loud, x = x.index_select(-1, self.apart), x.index_fill(-1, self.apart, 0)
        if self.two_part and x.numel() <= DECODE_ROWS * self.in_features:
            y = self._two_part(x)
        elif x.numel() == self.in_features:
            y = self._matmul(x)
        else:
            peak = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
            y = self._matmul(x / peak).mul_(peak)
        if self.weight_parts == 2:
            levels, rounded_off = y.split(self.out_features, -1)
            y = levels + rounded_off
        if self.apart is not None:
            y = self._add_apart(y, loud)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x):
        return self._fbgemm(x).mul_(self.scale)

    def _fbgemm(self, x, linear=lambda x, part: torch.ops.quantized.linear_dynamic(x, part, True)):
        """fbgemm's output for x, before the rows' scales."""
        parts = self.parts
        return linear(x, parts[0]) if len(parts) == 1 else torch.cat([linear(x, part) for part in parts], -1)

    def _two_part(self, x):
        """x's rows, each quantized as high + low / 126 (high: the row over its peak in 63 levels a side, low: what
        high rounded off, in as many), through one fbgemm call on the rows stacked; both parts are whole numbers in
        [-63, 63], which fbgemm's quantization at scale 1 and zero point 64 keeps exactly (7 bits, its AVX2 kernel's
        headroom).

        For decode rows only: there VNNI's kernel is bound by reading the weights, once for all rows, while a
        prompt's rows are bound by computing them, and twice the rows took the random 2B's prefill from 5.4 to 7.5 s
        for 0.4 dB of the logits' SQNR (Zen 4, scratch prefill_variant.py). The split and the join are jit's kernels
        once they are compiled: in torch's ops they are ~14 calls of a few microseconds each."""
        rows = x.reshape(-1, self.in_features).contiguous()
        if jit.ready.is_set():
            y = jit.in_two_parts(rows, lambda parts: self._fbgemm(parts, _whole_numbers), self.scale)
        else:
            parts, levels = self._split(rows)
            y = self._fbgemm(parts, _whole_numbers)
            y = y[:len(rows)].add_(y[len(rows):], alpha=1 / 126).mul_(levels).mul_(self.scale)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def _split(rows):
        """jit._split_kernel in torch's ops: rows as their whole numbers over each row's level (peak / 63), then what
        those rounded off times 126 (fbgemm rounds it, as it rounds its input), and the levels."""
        levels = rows.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(rows.dtype).tiny).div_(63)
        h = rows / levels
        parts = torch.empty(2 * len(rows), rows.shape[1])
        high, low = parts.split(len(rows))
        torch.round(h, out=high)
        torch.sub(h, high, out=low).mul_(126)
        return parts, levels

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"pieces={len(self.parts)}, apart={0 if self.apart is None else len(self.apart)}, "
                f"weight_parts={self.weight_parts}")


# Up to this many rows torch's int8 weight-only kernel wins; above, a bf16 GEMM on the weight converted to bf16 for
# the call (one 6144x2048 linear, Zen 5: 1.3 against 1.9 ms at 16 rows, 3.3 against 2.6 at 32, 34 against 13 at 400).
W8A16_ROWS = 16


class Int8WeightOnly(_Apart):
    """w8a16: int8 weights (symmetric, a bf16 scale per row) and bf16 activations, which are never quantized.

    For CPUs with bf16 dot products (AVX-512 BF16, AMX): fbgemm's dynamic int8 quantizes every activation, which
    costs the model's precision. Here only the weights are rounded: on the random 2B's text (`python -m qvl.bench
    --random-weights [--outliers] --linears`) the logits keep 21.1 dB of SQNR against fbgemm int8's 12.4, as much
    with planted outliers (loud channels apart in both), for a decode step ~1.3x fbgemm's (the same bytes, read
    slower: 0.50 against 0.44 ms for a 6144x2048 linear out of cache, 83 against 65 ms for the 2B's step; Zen 5).
    The scale multiplies each output column, so both paths compute the same products (within bf16 rounding).

    Where activations carry outliers, their readers' weights for those channels are small, and a row's int8 levels,
    set by its largest weights, round them off: loud channels apart (set_loud_channels_apart) have their int8
    columns zeroed and are computed in fp32 against the checkpoint's weights, two small ops a call.
    """

    def __init__(self, int8_weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = int8_weight.shape
        self.register_buffer("int8_weight", int8_weight)
        self.register_buffer("scale", scale)  # bf16: the kernel's own dtype, so both paths read the same scale
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> "Int8WeightOnly":
        q, scale = _int8_rows(linear.weight.detach(), torch.bfloat16)
        return cls(q, scale.bfloat16(), None if linear.bias is None else linear.bias.detach().float())

    def set_apart(self, channels: torch.Tensor, columns: torch.Tensor):
        super().set_apart(channels, columns)
        self.int8_weight[:, channels] = 0  # their part comes from columns alone

    def forward(self, x):
        rows = x.reshape(-1, self.in_features)
        flat = rows.bfloat16()
        if flat.shape[0] <= W8A16_ROWS:
            y = torch._weight_int8pack_mm(flat, self.int8_weight, self.scale).float()
        else:
            y = F.linear(flat, self.int8_weight.to(torch.bfloat16)).float().mul_(self.scale.float())
        if self.apart is not None:
            y = self._add_apart(y, rows.index_select(-1, self.apart))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# Channels whose activations stand far above the rest (real checkpoints' outliers, 20-100x in a few channels) would
# set the scale that fbgemm quantizes every channel of a call with, and their readers' weights, small, lose most of
# their precision to a row's int8 levels. They are found once, when a start converts the checkpoint, from what each
# text linear reads in one chat turn in the checkpoint's own markup (~100 tokens with Qwen's tokenizer, ~320 with the
# byte tokenizer of the tiny and random models), and then computed apart.
CALIBRATION = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is in this photo? "
               "Describe the main objects, their colours and where they are, then read any text you can see."
               "<|im_end|>\n"
               "<|im_start|>assistant\nThe photo shows a wooden table by a window. On it stand a red mug, a blue "
               "notebook and a small green plant; behind them, a sign reads \"Open 9-17\".<|im_end|>\n")
LOUD = 8.0  # a channel is computed apart once its peak in the calibration is this many times the median channel's
MOST_APART = 0.01  # of a linear's input channels (at least 4): the loudest, should a checkpoint have more


def set_loud_channels_apart(model: nn.Module, folder: str):
    """Find the loud input channels of every int8 text linear (fbgemm's, int4's int8 prefill twins, w8a16's) in the
    calibration turn, and have each compute its own apart against the checkpoint's weights for them.

    On the random 2B with planted outliers (`python -m qvl.bench --random-weights --outliers --linears`), ~5.5
    channels a linear: fbgemm int8 from -2.2 to 12.4 dB of SQNR (top-1 agreement 0 -> 0.52), w8a16 from 13.8 to
    21.1 dB (0.5 -> 0.78), its level on plain weights. Plain random weights have no channel loud enough, and nothing
    changes. The vision tower, which only ever prefills with a scale per token, is left as it is.
    """
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, _Apart) and not name.startswith("model.visual.")}
    loud = loud_channels(model, folder, linears)
    reads = {name: name.removesuffix(".prefill") for name in loud}  # int4's int8 prefill twin reads its linear's
    columns = checkpoint_columns(model, folder, {reads[name]: channels for name, channels in loud.items()})
    found = {name: channels for name, channels in loud.items() if reads[name] in columns}
    for name, channels in found.items():
        linears[name].set_apart(channels, columns[reads[name]])
    log.info("computing %d loud input channels apart in %d of %d int8 text linears",
             sum(map(len, found.values())), len(found), len(linears))
    if missed := sorted(set(reads.values()) - set(columns)):  # a layout this reader does not know: kept in int8
        log.warning("the checkpoint does not name the weights of %s: its loud channels stay in the int8 path",
                    ", ".join(missed[:3]))


def loud_channels(model: nn.Module, folder: str, linears: dict) -> dict:
    """{name: its loud input channels (int64, ascending)} for each of linears ({name: module}) that has any in the
    calibration turn (folder's tokenizer) through model; "lm_head" is read at the final norm (it sees one position)."""
    from transformers import AutoTokenizer

    peaks = {}

    def record(name, x):
        peak = x.detach().reshape(-1, x.shape[-1]).abs().amax(0)
        peaks[name] = torch.maximum(peaks[name], peak) if name in peaks else peak

    norm, hooks = model.model.language_model.norm, []
    if "lm_head" in linears:
        hooks.append(norm.register_forward_hook(lambda module, args, out: record("lm_head", out)))
    hooks += [module.register_forward_pre_hook(lambda module, args, name=name: record(name, args[0]))
              for name, module in linears.items() if name != "lm_head"]
    ids = AutoTokenizer.from_pretrained(folder)(CALIBRATION, return_tensors="pt").input_ids
    try:
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    loud = {}
    for name, peak in peaks.items():
        channels = (peak > LOUD * peak.median()).nonzero().squeeze(1)
        channels = channels[peak[channels].argsort(descending=True)[:max(4, int(len(peak) * MOST_APART))]]
        if len(channels):
            loud[name] = channels.sort().values
    return loud


def checkpoint_columns(model: nn.Module, folder: str, loud: dict) -> dict:
    """For each (fused) text linear name of loud whose weights the checkpoint names, its weights for the loud input
    channels, [channels, out_features], from one pass that reads only those linears' weights (the tied head's from
    the token table, which the model keeps in bf16 as the checkpoint has it)."""
    from qvl.engine import lean

    parts = {name: lean.parts(name) for name in loud}
    owner = {f"{part}.weight": name for name, names in parts.items() for part in names}
    found = {weight: tensor[:, loud[owner[weight]]]
             for weight, tensor in _checkpoint_tensors(folder, lambda weight: weight in owner)}
    if "lm_head" in loud and model.config.tie_word_embeddings:
        found["lm_head.weight"] = model.model.language_model.embed_tokens.weight[:, loud["lm_head"]]
    return {name: torch.cat([found[f"{part}.weight"] for part in names]).T for name, names in parts.items()
            if all(f"{part}.weight" in found for part in names)}


def _whole_numbers(x: torch.Tensor, part) -> torch.Tensor:
    """fbgemm's linear of x, whole numbers in [-63, 63], quantized at scale 1 and zero point 64: exactly."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 64, part)


def _pack(values: torch.Tensor):
    # At scale 1: for a per-channel weight fbgemm's prepack reads each row's scale and zero point through a tensor of
    # its own (~1.9 us a row, a fifth of the packing's time; a second start of the 2B read and packed in 5.5-6.3 s
    # against 6.8-8.2 s, Zen 3, scratch readab.py), for one multiply of each call's output (~2% of a decode step).
    return torch.ops.quantized.linear_prepack(at_scale_one(values), None)


def _values(part) -> torch.Tensor:
    """The int8 values fbgemm's packed part holds (a copy)."""
    return torch.ops.quantized.linear_unpack(part)[0].int_repr()


def _replace_linears(root: nn.Module, convert):
    """Swap every nn.Linear under root for convert(name, linear), freeing each bf16 weight in turn."""
    linears = [(name, module) for name, module in root.named_modules() if isinstance(module, nn.Linear)]
    for name, converted in side_by_side((name, functools.partial(convert, name, module)) for name, module in linears):
        swap(root, name, converted)


def swap(root: nn.Module, name: str, new: nn.Module):
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent), child, new)


# The checkpoint's dtypes, and the model cache's (int8 weights, packed int4 bytes, float64 per-channel scales).
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def file_tensors(path: Path, wanted=lambda name: True):
    """Every (name, tensor) of one safetensors file that wanted(name), in file order, read with plain file reads, one
    at a time.

    from_pretrained memory-maps the files, and every page it touched stays resident, counted in the process's
    memory, until loading ends: 4.3 GB of bf16 on top of the quantized copies being made.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, meta in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
            if not wanted(name):
                continue
            start, end = meta["data_offsets"]
            f.seek(8 + size + start)
            dtype = DTYPES[meta["dtype"]]
            data = bytearray(end - start)
            if f.readinto(data) != len(data):
                raise EOFError(f"{path} ends inside {name}")
            yield name, torch.frombuffer(data, dtype=dtype).reshape(meta["shape"]) if data else torch.empty(
                meta["shape"], dtype=dtype)


def _checkpoint_tensors(folder: str, wanted=lambda name: True):
    for path in sorted(Path(folder).glob("*.safetensors")):
        yield from file_tensors(path, wanted)


def skeleton(folder: str) -> nn.Module:
    """The model built from the folder's config, its weights allocated but never initialised (so not resident)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16).eval()


def side_by_side(jobs, workers: int | None = None):
    """(name, job()) for each (name, job) of jobs, in order, running up to `workers` jobs at once (default: torch's
    intra-op threads).

    fbgemm packs a weight in one thread with the GIL released, and packing is most of a quantized load (39 of the
    45 s a stored 2B int8 model took, on a 2-core AVX2 EPYC): on two cores two linears pack side by side. At most
    workers + 1 jobs are in flight, so that many layers' source tensors at most are held beside the model.
    """
    workers = workers or torch.get_num_threads()
    with ThreadPoolExecutor(workers, thread_name_prefix="convert", initializer=cpu.background) as pool:
        pending = collections.deque()
        for name, job in jobs:
            pending.append((name, pool.submit(job)))
            if len(pending) > workers:
                name, done = pending.popleft()
                yield name, done.result()
        for name, done in pending:
            yield name, done.result()


def unreported(phase: str, done: float | None):
    """How far a load is, for a load that nobody watches: phase (what it does) and the fraction done, None if unknown."""


def _load_converting(folder: str, convert, report=unreported) -> nn.Module:
    """The model filled tensor by tensor, each linear converted as soon as its weights are in.

    The skeleton's weights are never initialised (untouched memory is not resident), so the process holds the
    converted model plus a few layers, never a full bf16 copy. Raises KeyError for a checkpoint laid out otherwise.
    """
    from qvl.engine import lean

    model = skeleton(folder)
    config = model.config
    expected, loaded = set(model.state_dict()), set()  # the checkpoint's names, before fusing
    lean.fuse(model, copy=False)
    # Converting is most of the time, so a linear counts once converted, by its size (the tied head is one of them).
    sizes = {name: module.weight.numel() for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    done, total = 0, sum(sizes.values())
    report("converting", 0.0)
    embedding = EMBEDDING + ".weight"

    def linears():
        """The checkpoint streamed into the skeleton; (name, conversion) for each linear once its weights are in."""
        for name, tensor in _checkpoint_tensors(folder):
            if name not in expected:
                raise KeyError(f"unexpected checkpoint tensor {name}")
            if name in loaded:  # a tied head saved anyway: it is the embedding, already in
                continue
            loaded.add(name)
            if module_name := lean.place(model, name, tensor):  # q/k/v or gate/up: rows of a fused linear
                module = model.get_submodule(module_name)
                if set(lean.sources(module_name, module)) <= loaded:
                    yield module_name, functools.partial(convert, module_name, module)
                continue
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
            if name == embedding and config.tie_word_embeddings:
                # The head is the token table: quantize it now, while little else is resident (~1 GB of room).
                model.lm_head.weight = module.weight
                loaded.add("lm_head.weight")
                yield "lm_head", functools.partial(convert, "lm_head", model.lm_head)
            elif isinstance(module, nn.Linear) and set(lean.sources(module_name, module)) <= loaded:
                yield module_name, functools.partial(convert, module_name, module)

    for name, converted in side_by_side(linears()):
        swap(model, name, converted)
        heap.trim()
        done += sizes[name]
        report("converting", done / total)
    if missing := expected - loaded:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:3]}")
    return model


def _float_rest(model: nn.Module):
    """Everything not quantized (norms, biases, convs, position tables) computes in fp32."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dtype == torch.bfloat16:
                param.data = param.data.float()


def _int8(name: str, linear: nn.Linear) -> nn.Module:
    return _dynamic_int8(linear)


def _w8a14(name: str, linear: nn.Linear) -> nn.Module:
    first = name.startswith(tuple(f"model.language_model.layers.{i}." for i in range(TWO_PART_LAYERS)))
    return _dynamic_int8(linear, parts=2 if first else 1)


def _int4(name: str, linear: nn.Linear) -> nn.Module:
    if name.startswith("model.visual."):  # the vision tower only ever prefills: fbgemm int8 is fastest there
        return _dynamic_int8(linear)
    return Int4Linear.quantize(linear, prefill=name != "lm_head")  # the head's prefill needs only the last row's logits


def _w8a16(name: str, linear: nn.Linear) -> nn.Module:
    return Int8WeightOnly.quantize(linear)


def in_two_parts(model: nn.Module):
    """w8a14: every fbgemm text linear quantizes each decode row in two parts (Int8Linear._two_part); the vision tower
    only prefills."""
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear) and not name.startswith("model.visual."):
            module.two_part = True


def describe(mode: str) -> str:
    """The precision/quantization of a concrete mode, as the engine reports it (and puts in its identity)."""
    return {
        # Part of the answer cache's key: it names what changes answers (the activation scale per token, too).
        "int8": "int8: fbgemm dynamic int8 linears and head, a scale per token, loud text channels apart, "
                "embedding bf16",
        "int4": f"int4: vision fbgemm int8, text int4 g{GROUP} decode + int8 prefill, a scale per token, loud text "
                "channels apart, head int4, embedding bf16",
        "w8a16": "w8a16: int8 weights (a scale per row) with bf16 activations for every linear and the head, loud "
                 "text channels apart, embedding bf16",
        "w8a14": "w8a14: fbgemm int8 linears and head, a scale per token, decode rows in two parts (14 bits), "
                 "loud text channels apart, embedding bf16",
    }.get(mode, mode)


def load_model(source: str, mode: str, report=unreported) -> nn.Module:
    """The model of source (a checkpoint folder) in `mode` (describe() says what that is); report is told how far it
    is, as unreported is."""
    from transformers import AutoModelForImageTextToText

    from qvl.engine import lean

    mode = resolve(mode)
    if mode in ("fp32", "bf16"):
        report("loading", None)  # transformers' own load says nothing until it is done
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype).eval()
        lean.fuse(model)
        return model
    convert = {"int8": _int8, "w8a14": _w8a14, "int4": _int4, "w8a16": _w8a16}[mode]
    try:
        model = _load_converting(source, convert, report)
    except KeyError as e:  # a layout this loader does not know: convert after a whole bf16 load (more memory)
        log.warning("%s: loading the checkpoint whole before quantizing it", e)
        report("converting", None)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.bfloat16).eval()
        lean.fuse(model)
        _replace_linears(model, convert)
    text = model.model.language_model
    # The head is tied to the token table: the head was quantized for its per-step matmul, while the table stays a
    # bf16 gather (fp32 would add 1.2 GB for a lookup of one row per token).
    text.embed_tokens = Bf16Embedding(text.embed_tokens.weight)
    _float_rest(model)
    if mode == "w8a14":
        in_two_parts(model)
    set_loud_channels_apart(model, source)
    return model
