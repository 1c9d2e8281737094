"""The quantized layers: each holds its weights in the form its kernel reads, and computes a float input to a float
output (fbgemm's int8 linear, int8 weight-only, int4 weight-only, the bf16 token table).

qvl.engine.checkpoint converts a checkpoint's linears into these; qvl.engine.modelcache stores them and reads them
back. What each mode computes, and why: docs/quantization.md.
"""
import contextvars
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from qvl.engine import jit, vnni
from qvl.engine.modes import GROUP

DECODE_ROWS = 8  # up to this many rows the int4 kernel is bandwidth-bound and wins; above, int8 compute wins
# Set while a prompt is prefilled: int4 then takes its int8 twin however few the rows, so that the part of a prompt
# left after a kept prefix (Regenerate's one token) is computed on the weights a whole prompt's tokens are. w8a14's
# few-row split stays: it is nearer fp32 than a prompt's rows, and conversation memory only has to be no farther.
prompting = contextvars.ContextVar("prompting", default=False)
# Modes whose decode steps read other weights than their prompts (int4's prompts run on int8 twins): a position they
# decoded is not what a prompt computes there, so conversation memory keeps only what their prompts computed.
PROMPT_TWINS = frozenset({"int4"})


class Stored(nn.Module):
    """A layer that says how it is stored: to_tensors() gives its tensors by name and from_tensors() builds it again
    from them, answering exactly as before (the model cache keeps every layer so, and its LAYOUT changes with them)."""

    # Tensors that from_tensors() only reads (fbgemm packs them into a layout of its own) and does not keep: a store
    # may hand them over as views of its file.
    BORROWED = ()

    def to_tensors(self, data: bool = True):
        """(name, chunks) for each tensor, where chunks is a tensor or an iterable of tensors joined along the first
        dimension; without data, a tensor slow to make may be a stand-in of its dtype and shape on the meta device."""
        raise NotImplementedError

    @classmethod
    def from_tensors(cls, tensors: dict, pack=map) -> "Stored":
        """The layer of to_tensors()'s tensors ({name: tensor}); pack: map, or one that packs pieces side by side."""
        raise NotImplementedError


class Bf16Embedding(Stored):
    """The token table in bf16 (a gather reads one row per token, so precision costs nothing in speed)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))  # a buffer: model.dtype stays fp32

    def to_tensors(self, data=True):
        yield "weight", self.weight

    @classmethod
    def from_tensors(cls, tensors, pack=map):
        return cls(tensors["weight"])

    def forward(self, ids):
        return F.embedding(ids, self.weight).float()


class Int4Linear(Stored):
    """Weight-only int4 (asymmetric, groups of GROUP) with bf16 activations; an optional fbgemm int8 twin for prefill.

    Built from its stored tensors (the model cache) or by quantize() from a float linear.
    """

    BORROWED = ("prefill.qweight",)

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

    def to_tensors(self, data=True):
        """Its packed weight, scales and zeros, and its out_features (the weight has rows up to a multiple of 16)."""
        yield from [("packed", self.packed), ("scale_zero", self.scale_zero),
                    ("out_features", torch.tensor([self.out_features]))]
        if self.bias is not None:
            yield "bias", self.bias.detach()
        if self.prefill is not None:
            yield from ((f"prefill.{name}", chunks) for name, chunks in self.prefill.to_tensors(data))

    @classmethod
    def from_tensors(cls, tensors, pack=map):
        twin = {name.removeprefix("prefill."): t for name, t in tensors.items() if name.startswith("prefill.")}
        return cls(tensors["packed"], tensors["scale_zero"], tensors.get("bias"), int(tensors["out_features"]),
                   Int8Linear.from_tensors(twin, pack) if twin else None)

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

    In slices of ~1M values (4 MB in fp32), which stay in the CPU's caches between the passes over them, divided and
    rounded in place, without a clamp (a row's peak over its scale rounds to 127 at most, a bf16-rounded scale
    included: it is at most 2^-8 below the exact one), so that quantizing a weight costs less than packing it
    (docs/quantization.md, "Converting and reading fast").
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
    return Int8Linear(q, scale, None if linear.bias is None else linear.bias.detach().float(), rows=_piece_rows(q),
                      parts=parts)


def _piece_rows(values: torch.Tensor) -> int:
    """The rows of a piece of values: every start packs int8 weights in pieces, which fbgemm packs faster per value,
    and the engine settles them into fewer once it serves (Int8Linear.settle)."""
    return max(1, PIECE // values.shape[1])


# torch 2.13 deprecates quantized dtypes (pytorch#184982), which fbgemm's linear still takes, and says so at every
# start; the README says what replaces them when they go. Set once here: catch_warnings is not safe in the threads
# that convert linears side by side.
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")


def at_scale_one(values: torch.Tensor) -> torch.Tensor:
    """int8 values as the torch.qint8 tensor (scale 1, zero point 0) that fbgemm packs, over their own memory, since
    fbgemm copies them to pack anyway and torch's _make_*_quantized_tensor functions would copy them once more
    (seconds of a start: docs/quantization.md, "Converting and reading fast")."""
    weight = torch._empty_affine_quantized(values.shape, scale=1.0, zero_point=0, dtype=torch.qint8)
    return weight.set_(values.untyped_storage(), values.storage_offset(), values.shape, values.stride())


# What packs int8 weights unless a start asks for oneDNN: fbgemm's, through torch's "x86" engine (none on Arm).
_DEFAULT_ENGINE = torch.backends.quantized.engine


def use_kernel(kernel: str):
    """Pack the int8 linears built from now on for kernel ("fbgemm" or "onednn", modes.kernel): torch's quantized
    engine, one a process, chooses what linear_prepack makes, and the packed weight what computes it."""
    wanted = "onednn" if kernel == "onednn" else _DEFAULT_ENGINE
    if torch.backends.quantized.engine != wanted:
        torch.backends.quantized.engine = wanted


# Every start packs int8 weights in pieces of PIECE values, which fbgemm packs faster per value than larger ones, and
# the engine repacks them in the background into the fewer pieces of up to SETTLED_ROWS rows that decode faster, each
# repack short enough not to hold up a request (docs/quantization.md, "Converting and reading fast").
PIECE = 4 << 20
SETTLED_ROWS = 16384


class _Apart(Stored):
    """A linear that computes a few loud input channels apart (checkpoint.set_loud_channels_apart finds them): out of
    its int8 path, and added back in fp32 against the checkpoint's own weights for them (`columns`, [channels,
    out_features])."""

    def __init__(self):
        super().__init__()
        self.register_buffer("apart", None)
        self.register_buffer("columns", None)

    def set_apart(self, channels: torch.Tensor, columns: torch.Tensor):
        """Compute these input channels (int64, ascending) apart, against columns."""
        self.apart, self.columns = channels, columns.float().contiguous()

    def _apart_tensors(self):
        return [] if self.apart is None else [("apart", self.apart), ("columns", self.columns)]

    def _apart_from(self, tensors: dict) -> "_Apart":
        """self, computing apart the channels that tensors (_apart_tensors()'s) name, if any."""
        if "apart" in tensors:
            self.set_apart(tensors["apart"], tensors["columns"])
        return self

    def _add_apart(self, y: torch.Tensor, loud: torch.Tensor) -> torch.Tensor:
        return y.view(-1, self.out_features).addmm_(loud.reshape(-1, len(self.apart)), self.columns).view(y.shape)


# How many times the median row's peak a row of a bf16 tower's activations may reach before its linear takes a scale
# per token (Int8Linear.bf16_rows): four leaves the median row a quarter of the levels, 2 bits.
LOUD_ROWS = 4


class Int8Linear(_Apart):
    """A dynamic int8 linear with a scale per row: its int8 weight is packed into fbgemm's layout, or oneDNN's where
    torch's quantized engine is "onednn" as it is built (--int8-kernel), whole or in pieces of `rows` rows; each row's
    scale multiplies the output, and the kernel quantizes each call's input with one scale (fbgemm's to 7 bits: its
    AVX2 kernel needs the headroom; oneDNN's to 8, on CPUs with VNNI or AMX: modes.onednn_fits).

    One scale for a whole prompt is set by its loudest token, which leaves the quiet ones few levels: each row is
    brought to the same peak before the call and its output scaled back, which gives every token a scale of its own
    for four elementwise ops (~1% of a prefill). A single row (every decode step) has its own scale already and takes
    fbgemm's call unchanged (what it gains: docs/quantization.md, "A scale per token and the loud channels"). Pieces
    change no output bit: every piece quantizes the same input with the same scale, and each output channel is
    computed on its own.

    A scale per token cannot help where a few channels of every token are 20-100x the rest, as in real checkpoints:
    those channels (found by checkpoint.set_loud_channels_apart when the checkpoint is converted) are zeroed in
    fbgemm's input and their part of the output added back in fp32 against the checkpoint's weights (LLM.int8()'s
    split, with the channels fixed in advance: no search per call). Three small ops a call, in linears that have any.

    `w8a14` (two_part) feeds each decode row as two rows, whose 7 bits each make 14 (_two_part).

    parts=2 holds each weight row as two int8 rows: its levels, then what they rounded off in levels of its own (the
    first text layers', modes.TWO_PART_LAYERS). One fbgemm call reads both, and the output is their sum.
    """

    BORROWED = ("qweight",)

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
        self.two_part = False  # w8a14 (checkpoint.in_two_parts): each input row fed as two, for 14 bits instead of 7
        self.onednn = torch.backends.quantized.engine == "onednn"  # what _pack packed it for
        self._table = None, None  # the parts vnni's table was made for, and it

    def to_tensors(self, data=True):
        """Its weight as a per-channel torch.qint8 weight is stored (int8 values, unpacked a piece at a time, float64
        scales, int64 zero points, all 0), its parts, bias, loud channels and whether it feeds decode rows in two."""
        rows = len(self.scale)  # two per output channel where its weights are in two parts
        values = self.pieces() if data else torch.empty((rows, self.in_features), dtype=torch.int8, device="meta")
        yield from [("qweight", values), ("scale", self.scale.double()),
                    ("zero_point", torch.zeros(rows, dtype=torch.int64))]
        if self.weight_parts > 1:
            yield "weight_parts", torch.tensor([self.weight_parts])
        if self.two_part:
            yield "two_part", torch.tensor([1])
        yield from self._apart_tensors()
        if self.bias is not None:
            yield "bias", self.bias.detach()

    @classmethod
    def from_tensors(cls, tensors, pack=map):
        if tensors["zero_point"].any():  # no conversion of qvl's makes them: not a file of its own
            raise ValueError("asymmetric int8 weights")
        values = tensors["qweight"]
        linear = cls(values, tensors["scale"], tensors.get("bias"), rows=_piece_rows(values), pack=pack,
                     parts=int(tensors.get("weight_parts", 1)))
        linear.two_part = "two_part" in tensors
        return linear._apart_from(tensors)

    def weight(self) -> torch.Tensor:
        """The per-channel torch.qint8 weight as stored (with parts=2, both parts' rows; a copy)."""
        return torch._make_per_channel_quantized_tensor(torch.cat(list(self.pieces())), self.scale.double(),
                                                        torch.zeros(len(self.scale), dtype=torch.long), 0)

    def pieces(self):
        """The int8 values a piece at a time, unpacked as asked for (copies), their rows in order."""
        return (_values(part) for part in self.parts)

    def settle(self, rows: int = SETTLED_ROWS) -> bool:
        """Repack the next run of loaded pieces that fits in `rows` rows as one piece; False once none is left."""
        if self.onednn != (torch.backends.quantized.engine == "onednn"):
            return False  # the process packs for the other kernel now (tests switch): the pieces answer as they did
        run = max(1, rows // self.rows)
        while self.merged < len(self.parts):
            start, self.merged = self.merged, self.merged + 1
            group = self.parts[start:start + run]
            if len(group) > 1:
                merged = _pack(torch.cat([_values(part) for part in group]))
                # One assignment: a call in flight keeps the list it read, which computes the same numbers.
                self.parts = [*self.parts[:start], merged, *self.parts[start + run:]]
                self._table = None, None  # vnni's table would keep the replaced pieces' memory
                return True
        return False

    def forward(self, x):
        if x.dtype == torch.bfloat16:
            return self.bf16_rows(x)
        if x.numel() <= vnni.ROWS * self.in_features and (table := self.vnni_table()) is not None:
            y = vnni.linear(x, table)  # decode rows: their loud channels and weight parts too, in one call
            return y if self.bias is None else y + self.bias
        if self.apart is not None:
            loud, x = x.index_select(-1, self.apart), x.index_fill(-1, self.apart, 0)
        if self.two_part and x.numel() <= DECODE_ROWS * self.in_features:
            y = self._two_part(x)
        elif x.numel() == self.in_features:
            y = self._matmul(x)
        else:
            y = self._per_token(x)
        if self.weight_parts == 2:
            levels, rounded_off = y.split(self.out_features, -1)
            y = levels + rounded_off
        if self.apart is not None:
            y = self._add_apart(y, loud)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x):
        return self._int8(x, _dynamic).mul_(self.scale)

    def bf16_rows(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """The linear of a tower that computes in bf16 (--vision-dtype int8), gelu (tanh) applied where asked: x
        (bf16) quantized to 8 bits at one scale and zero point for all its rows (gelu's outputs, into the MLP's second
        linear, lie mostly above 0), and oneDNN's kernel adding the bias, applying the gelu and rounding to bf16 as it
        writes its fp32 sums. One scale, not one a token: the tower's linears read
        rows that a LayerNorm made (or attention and gelu made of such rows), whose peaks differ little, and one
        scale leaves the kernel to finish the output, where a scale per token takes passes of its own that cost
        what the int8 kernel saves over bf16's (docs/quantization.md, "The vision tower"). Where a row is loud
        (LOUD_ROWS), as a ViT's few high-norm tokens are, one scale would leave the others few levels: there, and
        where the kernel is not oneDNN's (or with two weight parts, loud channels), the float32 path at a scale per
        token, then the gelu and bf16."""
        levels = None
        if self.onednn and self.weight_parts == 1 and self.apart is None:
            levels = (jit.tensor_levels if jit.ready.is_set() else tensor_levels)(x, LOUD_ROWS)
        if levels is None:
            y = self.forward(x.float())
            return (F.gelu(y, approximate="tanh") if gelu else y).bfloat16()
        return self._onednn_parts(*levels, None if self.bias is None else self.bias.float(), torch.bfloat16, gelu)

    def _per_token(self, x):
        """_matmul of x with a scale per token: each row over its own peak, times the peak again. On oneDNN the rows'
        one scale is known (127 levels of 1), so no pass looks for it, and the kernel multiplies by the weight rows'
        scales as it writes its output, not a pass of its own after it (together a third of what a prompt's int8
        linear cost around its kernel). At input scale 1 its output is each whole-number sum times its row's scale,
        rounded once, however the weight is cut into pieces."""
        if self.onednn and jit.ready.is_set():
            q, peak = jit.levels(x)  # the same levels in one kernel, where torch's ops took five passes
        else:
            peak = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
            if not self.onednn:
                return self._matmul(x / peak).mul_(peak)
            q = torch.quantize_per_tensor(x / peak, 1 / 127, 128, torch.quint8).int_repr()
        return self._onednn_parts(q, 1.0, 128).mul_(peak.div_(127))

    def _onednn_parts(self, q, scale: float, zero_point: int, bias: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32, gelu: bool = False) -> torch.Tensor:
        """_onednn over the packed parts, each with its rows' scales (and bias), joined."""
        outputs, start = [], 0
        for part in self.parts:  # oneDNN's packed weight is a tensor, in x out
            end = start + part.shape[1]
            outputs.append(_onednn(q, scale, zero_point, part, self.scale[start:end],
                                   None if bias is None else bias[start:end], dtype, gelu))
            start = end
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)

    def _int8(self, x, linear):
        """linear(x, part, onednn)'s output over the packed parts: the int8 kernel's, before the rows' scales."""
        parts = self.parts
        if len(parts) == 1:
            return linear(x, parts[0], self.onednn)
        return torch.cat([linear(x, part, self.onednn) for part in parts], -1)

    def _two_part(self, x):
        """x's rows, each quantized as high + low / 126 (high: the row over its peak in 63 levels a side, low: what
        high rounded off, in as many), through one fbgemm call on the rows stacked; both parts are whole numbers in
        [-63, 63], which fbgemm's quantization at scale 1 and zero point 64 keeps exactly (7 bits, its AVX2 kernel's
        headroom).

        For decode rows only: there the kernel is bound by reading the weights, once for all rows, while a prompt's
        rows are bound by computing them, and twice as many would cost a prompt more time than its precision is worth
        (docs/quantization.md, "How `w8a14` works"). The split and the join are jit's kernels once they are compiled,
        where torch's ops take ~14 small calls (up to vnni.ROWS rows on oneDNN's weights go to vnni's kernel:
        forward)."""
        rows = x.reshape(-1, self.in_features).contiguous()
        if jit.ready.is_set():
            y = jit.in_two_parts(rows, lambda parts: self._int8(parts, _whole_numbers), self.scale, self.onednn)
        else:
            parts, levels = self._split(rows)
            y = self._int8(parts, _whole_numbers)
            y = y[:len(rows)].add_(y[len(rows):], alpha=1 / 126).mul_(levels).mul_(self.scale)
        return y.view(*x.shape[:-1], -1)

    def vnni_table(self) -> "vnni.Table | None":
        """What vnni's kernels read of this linear for decode rows once they are warm, as its packed parts are now
        (settle() replaces them), or None: not w8a14's two parts, or packed otherwise than vnni reads. They read it
        faster than oneDNN's call up to vnni.ROWS rows (docs/quantization.md, "The decode kernel")."""
        if not (self.two_part and jit.ready.is_set() and vnni.ready):
            return None
        parts, (packed, table) = self.parts, self._table
        if packed is not parts:
            table = (vnni.Table(parts, self.scale, self.weight_parts, self.apart, self.columns)
                     if self.onednn and all(map(vnni.fits, parts)) else None)
            self._table = parts, table
        return table

    def set_apart(self, channels: torch.Tensor, columns: torch.Tensor):
        super().set_apart(channels, columns)
        self._table = None, None  # vnni's table holds the channels it was made with

    @staticmethod
    def _split(rows):
        """jit._split_kernel in torch's ops (float parts): rows as their whole numbers over each row's level (peak /
        63), then what those rounded off times 126, rounded, and the levels."""
        levels = rows.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(rows.dtype).tiny).div_(63)
        h = rows / levels
        parts = torch.empty(2 * len(rows), rows.shape[1])
        high, low = parts.split(len(rows))
        torch.round(h, out=high)
        torch.sub(h, high, out=low).mul_(126).round_()
        return parts, levels

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"pieces={len(self.parts)}, apart={0 if self.apart is None else len(self.apart)}, "
                f"weight_parts={self.weight_parts}")


# Up to this many rows torch's int8 weight-only kernel wins; above, a bf16 GEMM on the weight converted to bf16 for
# the call (docs/quantization.md, "How `w8a16` computes").
W8A16_ROWS = 16


class Int8WeightOnly(_Apart):
    """w8a16: int8 weights (symmetric, a bf16 scale per row) and bf16 activations, which are never quantized.

    For CPUs with bf16 dot products (AVX-512 BF16, AMX): fbgemm's dynamic int8 quantizes every activation, which
    costs the model's precision. Here only the weights are rounded, for a decode step somewhat slower than fbgemm's
    (the same bytes, read slower: docs/quantization.md, "How `w8a16` computes"). The scale multiplies each output
    column, so both paths compute the same products (within bf16 rounding).

    Where activations carry outliers, their readers' weights for those channels are small, and a row's int8 levels,
    set by its largest weights, round them off: loud channels apart (checkpoint.set_loud_channels_apart) have their int8
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

    def to_tensors(self, data=True):
        yield from [("int8_weight", self.int8_weight), ("scale", self.scale), *self._apart_tensors()]
        if self.bias is not None:
            yield "bias", self.bias.detach()

    @classmethod
    def from_tensors(cls, tensors, pack=map):
        return cls(tensors["int8_weight"], tensors["scale"], tensors.get("bias"))._apart_from(tensors)

    def set_apart(self, channels: torch.Tensor, columns: torch.Tensor):
        super().set_apart(channels, columns)
        self.int8_weight[:, channels] = 0  # their part comes from columns alone

    def bf16_weight(self) -> torch.Tensor:
        """The weights in bf16, times their row scales, made for one call: a tower that computes in bf16
        (--vision-dtype) keeps them int8 in memory."""
        if jit.ready.is_set():
            return jit.dequantized(self.int8_weight, self.scale)
        return self.int8_weight.to(torch.bfloat16).mul_(self.scale[:, None])

    def forward(self, x):
        if x.dtype == torch.bfloat16:
            return F.linear(x, self.bf16_weight(), self.bias)
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


def tensor_levels(x: torch.Tensor, loud: float) -> tuple[torch.Tensor, float, int] | None:
    """jit.tensor_levels in torch's ops: x (bf16) as oneDNN's uint8 input in 256 levels from its least value to its
    largest (0 within them; float32 scale), and the scale and the zero point; None where its loudest row's peak is over
    `loud` times the median row's (the lower median)."""
    peaks = x.reshape(-1, x.shape[-1]).abs().amax(-1).float()
    if peaks.max() > loud * peaks.median():
        return None
    low, high = (torch.minimum(x.min().float(), _ZERO), torch.maximum(x.max().float(), _ZERO))
    level = ((high - low) / 255).clamp_(min=torch.finfo(torch.float32).tiny)
    zero = int(torch.round(-low / level).clamp_(0, 255))
    return torch.quantize_per_tensor(x.float(), level.item(), zero, torch.quint8).int_repr(), level.item(), zero


_ZERO = torch.tensor(0.0)


def _dynamic(x: torch.Tensor, part, onednn: bool) -> torch.Tensor:
    """The kernel's linear of x, quantized at the scale its peak sets (fbgemm's 7 bits, oneDNN's 8, symmetric)."""
    if not onednn:
        return torch.ops.quantized.linear_dynamic(x, part, True)
    level = x.abs().amax().clamp_(min=torch.finfo(x.dtype).tiny).item() / 127
    return _onednn(torch.quantize_per_tensor(x, level, 128, torch.quint8).int_repr(), level, 128, part)


def _whole_numbers(x: torch.Tensor, part, onednn: bool) -> torch.Tensor:
    """The kernel's linear of x, whole numbers in [-63, 63] (or those plus 64 in uint8, as oneDNN takes them), at
    scale 1: exactly, so both kernels give the same numbers."""
    if x.dtype == torch.uint8:
        return _onednn(x, 1.0, 64, part)
    if not onednn:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 64, part)
    return _onednn(torch.quantize_per_tensor(x, 1.0, 64, torch.quint8).int_repr(), 1.0, 64, part)


def _onednn(q: torch.Tensor, scale: float, zero_point: int, part, row_scales: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, gelu: bool = False) -> torch.Tensor:
    """oneDNN's int8 linear of q (uint8 levels of scale, zero_point) into dtype, times row_scales (the weight rows'
    scales; without them, before the rows' scales), plus bias, through gelu (tanh) where asked: all applied by the
    kernel as it writes its fp32 sums."""
    rows, out_features = q.reshape(-1, q.shape[-1]), part.shape[1]  # packed as in x out
    row_scales = _ones(out_features) if row_scales is None else row_scales
    y = torch.ops.onednn.qlinear_pointwise(rows, scale, zero_point, part, row_scales, _zeros(out_features), bias,
                                           1.0, 0, dtype, "gelu" if gelu else "none", [], "tanh" if gelu else "")
    return y.view(*q.shape[:-1], out_features)


@functools.cache
def _ones(size: int) -> torch.Tensor:
    return torch.ones(size)


@functools.cache
def _zeros(size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.long)


def _pack(values: torch.Tensor):
    # At scale 1: a per-channel weight costs fbgemm's prepack a fifth of its time reading each row's scale and zero
    # point, where the rows' scales multiply each call's output for ~2% of a decode step.
    if torch.backends.quantized.engine == "onednn":
        # oneDNN's own int8 linear (the one torch.compile emits), not quantized.linear_prepack's oneDNN weight, which
        # keeps the values beside what it packs (2.2 GB more for the 2B). The copy: its packing may keep the memory
        # it packs from, which may be a stored model's file.
        return torch.ops.onednn.qlinear_prepack(values.clone(), None)
    return torch.ops.quantized.linear_prepack(at_scale_one(values), None)


def _values(part) -> torch.Tensor:
    """The int8 values a packed part holds (a copy)."""
    if isinstance(part, torch.Tensor):  # oneDNN's, laid out in x out
        return part.to_dense().t().contiguous()
    return torch.ops.quantized.linear_unpack(part)[0].int_repr()


# Every layer a converted model holds, by the name the model cache stores it under.
STORED = {kind.__name__: kind for kind in (Bf16Embedding, Int4Linear, Int8Linear, Int8WeightOnly)}
