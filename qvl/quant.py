"""Loading the model in the precision and quantization that is fastest on this CPU.

Measured on a quiet 2-core AVX2 EPYC (no AVX-512), one 2048x6144 linear, weights out of cache (`python -m qvl.bench`
has the whole-model figures): decode (1 row) fp32 4.8 ms, bf16 2.3, fbgemm dynamic int8 0.80, int8 weight-only 1.5,
int4 weight-only (group 128) 1.1; prefill (256 rows) fbgemm int8 216 GFLOP/s, fp32 78, int8/int4 weight-only ~46,
bf16 19 (no bf16 instructions: bf16 matmuls are emulated). So on AVX2 fbgemm int8 wins both phases (`int8`). On
AVX-512 BF16 CPUs (Zen 4/5, Sapphire Rapids) the int4 kernel decodes ~1.7x faster than fbgemm int8 (0.19 vs 0.32 ms
for that linear, measured on a Zen 5): `int4` keeps an int4 copy of each text linear for decode and an fbgemm int8
copy for prefill. Every mode loads the bf16 checkpoint and converts one linear at a time, so the process never holds
two full copies of the weights.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForImageTextToText

from qvl import cpu

MODES = ("auto", "fp32", "bf16", "int8", "int4")
GROUP = 128  # int4 scale/zero group: 32 gains little accuracy on these weights and decodes 40% slower
DECODE_ROWS = 8  # up to this many rows the int4 kernel is bandwidth-bound and wins; above, int8 compute wins


def resolve(mode: str, flags: frozenset[str] | None = None) -> str:
    """The concrete mode `auto` stands for on a CPU with these instruction sets (default: this CPU's)."""
    if mode != "auto":
        return mode
    flags = cpu.flags() if flags is None else flags
    if flags & {"BF16", "AMX"}:  # native bf16 dot products: the int4 decode kernel beats fbgemm int8
        return "int4"
    # fbgemm needs AVX2; without it, it and the int4 kernel fall back to scalar loops slower than fp32.
    return "int8" if "AVX2" in flags else "fp32"


class Bf16Embedding(nn.Module):
    """The token table in bf16 (a gather reads one row per token, so precision costs nothing in speed)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))  # a buffer: model.dtype stays fp32

    def forward(self, ids):
        return F.embedding(ids, self.weight).float()


class Int4Linear(nn.Module):
    """Weight-only int4 (asymmetric, groups of GROUP) with bf16 activations; an optional fbgemm int8 twin for prefill."""

    def __init__(self, linear: nn.Linear, prefill: bool):
        super().__init__()
        w = linear.weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.group = min(GROUP, self.in_features)  # the tiny test model's layers are narrower than a group
        # The kernel packs rows in blocks of 16: pad with zero rows (the tiny model's 270-token vocabulary).
        w = F.pad(w, (0, 0, 0, -self.out_features % 16))
        groups = w.reshape(w.shape[0], -1, self.group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(w.shape)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel dequantizes as (q - 8) * scale + zero, so the zero point is the value of q = 8.
        zero = low + 8 * scale
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).squeeze(2).transpose(0, 1).contiguous().bfloat16())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float())
        self.prefill = _dynamic_int8(linear) if prefill else None

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        if self.prefill is not None and flat.shape[0] > DECODE_ROWS:
            return self.prefill(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.bfloat16(), self.packed, self.group, self.scale_zero).to(x.dtype)
        y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _dynamic_int8(linear: nn.Linear) -> nn.Module:
    """fbgemm dynamic int8 (per-channel weights, activations quantized per call): the write-up's recipe."""
    fp32 = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    fp32.load_state_dict({k: v.float() for k, v in linear.state_dict().items()})
    fp32.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return torch.ao.nn.quantized.dynamic.Linear.from_float(fp32)


def _replace_linears(root: nn.Module, make):
    """Swap every nn.Linear under root for make(linear), one at a time, so its bf16 weight is freed before the next."""
    for name, module in list(root.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent_name), child, make(module))


def _float_rest(model: nn.Module):
    """Everything not quantized (norms, biases, convs, position tables) computes in fp32."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dtype == torch.bfloat16:
                param.data = param.data.float()


def load_model(source: str, mode: str):
    """Load source (hub id or folder) in `mode`; return (model, description of precision/quantization)."""
    mode = resolve(mode)
    if mode in ("fp32", "bf16"):
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        return AutoModelForImageTextToText.from_pretrained(source, dtype=dtype).eval(), mode
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.bfloat16).eval()
    text = model.model.language_model
    # The head is tied to the token table: the head is quantized for its per-step matmul, while the table stays a
    # bf16 gather (fp32 would add 1.2 GB for a lookup of one row per token).
    text.embed_tokens = Bf16Embedding(text.embed_tokens.weight)
    if mode == "int8":
        _replace_linears(model, _dynamic_int8)
        _float_rest(model)
        return model, "int8: fbgemm dynamic int8 linears and head, embedding bf16"
    _replace_linears(model.model.visual, _dynamic_int8)
    _replace_linears(text, lambda linear: Int4Linear(linear, prefill=True))
    model.lm_head = Int4Linear(model.lm_head, prefill=False)  # prefill only needs the last row's logits
    _float_rest(model)
    return model, f"int4: vision fbgemm int8, text int4 g{GROUP} decode + int8 prefill, head int4, embedding bf16"
