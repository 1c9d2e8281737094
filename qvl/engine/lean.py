"""The text decoder's decode step written out, in the spirit of gpt-fast, and the fused linears it runs on.

transformers' forward spends a large share of a quantized 2B decode step outside the matmuls: a cache object and a
causal mask per call, M-RoPE positions rebuilt from the cache, a concatenation of every layer's keys and values,
and five linears per layer that each quantize the same activation again. Decoder.step is one token through the
text decoder: its own loop over the layers, keys and values written into buffers with room for the whole answer,
the position computed directly (after the prompt all three M-RoPE sections advance together, from the cache
length plus the prompt's delta, which the caller computes per prompt: generate.positions), q/k/v as one linear and
gate/up as one.

Fusing is exact: int8 and int4 weights are quantized row by row (per output channel, or per group along a row),
so the rows of the fused weight are the rows of the separate ones, and fbgemm quantizes the shared input once with
the scale each of the three would have computed. Prefill stays on transformers' forward (images, deepstack,
3-D positions, causal mask), which calls the fused modules through the same interface as its own.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.activations import GELUTanh
from transformers.initialization import no_init_weights
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_vl.modeling_qwen3_vl import (Qwen3VLTextRMSNorm, apply_rotary_pos_emb,
                                                            apply_rotary_pos_emb_vision, eager_attention_forward)

from qvl.engine import cpu, heap, jit, quant, vnni

# A fused linear's name -> the checkpoint linears whose rows it holds, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PART = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}


def _linear(parts: list[nn.Linear], copy: bool) -> nn.Linear:
    """One linear with the parts' output rows stacked; copy=False leaves its weights unset (never touched, so not
    resident) for a loader to fill."""
    first = parts[0]
    with no_init_weights():
        out = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                        dtype=first.weight.dtype)
    out.requires_grad_(False)
    if copy:
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out


class Attention(nn.Module):
    """Qwen3-VL's text attention with one q/k/v linear; forward() is transformers' interface, step() the lean one."""

    def __init__(self, hf: nn.Module, copy: bool):
        super().__init__()
        self.config, self.layer_idx, self.head_dim, self.scaling = hf.config, hf.layer_idx, hf.head_dim, hf.scaling
        self.num_key_value_groups, self.is_causal, self.attention_dropout = hf.num_key_value_groups, True, 0.0
        self.sizes = [hf.q_proj.out_features, hf.k_proj.out_features, hf.v_proj.out_features]
        self.heads = [size // self.head_dim for size in self.sizes]
        self.qkv_proj = _linear([hf.q_proj, hf.k_proj, hf.v_proj], copy)
        self.o_proj, self.q_norm, self.k_norm = hf.o_proj, hf.q_norm, hf.k_norm
        # What forward() attends over a prompt in, and what keys and values are kept in: None, the activations'
        # dtype (set_dtypes).
        self.prompt_dtype = self.cache_dtype = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.view(*x.shape[:-1], -1, self.head_dim).split(self.heads, -2)
        if jit.ready.is_set() and len(x) == 1 and qkv.dtype == cos.dtype == torch.float32:
            q, k = jit.prompt_rope(qkv, self.qk_weight(), self.q_norm.variance_epsilon, cos, sin, self.heads)
        else:
            q, k = apply_rotary_pos_emb(self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        q, k, v = self._qkv(hidden_states, *position_embeddings)
        if cache is not None:
            kept = self.cache_dtype or k.dtype
            k, v = cache.update(k.to(kept), v.to(kept), self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        dtype = self.prompt_dtype or q.dtype
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(dtype)
        out, weights = attend(self, q.to(dtype), k.to(dtype), v.to(dtype), attention_mask, dropout=0.0,
                              scaling=self.scaling, **kwargs)
        return self.o_proj(out.to(hidden_states.dtype).reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    def step(self, x, cos, sin, keys: list, values: list, n: list[int], qk_weight: torch.Tensor):
        """One new position for each row of x (B x 1 x hidden): row b's keys and values written into its buffers
        (keys[b], values[b]) at n[b], attending to its positions 0..n[b]; q/k/v and o for all rows in one linear each.

        q and k are normalised and rotated together (qk_weight: q_norm's weight for each query head, then k_norm's
        for each key head; sin: the step's sines with the first half negated, so that rotate_half's negate-and-concat
        is one roll): each elementwise op costs ~5 us whatever its size, and a layer has dozens.
        """
        qkv, outs = self.qkv_proj(x), []
        for b in range(len(n)):
            outs.append(self._attend(qkv[b], cos[b], sin[b], keys[b], values[b], n[b], qk_weight))
        out = outs[0] if len(outs) == 1 else torch.stack(outs)
        return self.o_proj(out.view(len(n), 1, -1))

    def _attend(self, qkv, cos, sin, keys: torch.Tensor, values: torch.Tensor, n: int, qk_weight: torch.Tensor):
        """One row's attention output (kv heads x queries each x head_dim) from its q/k/v row, over its own cache."""
        # numpy, and so numba, has no bfloat16: a bf16 cache travels as its bits, bf16 activations take torch's ops.
        if jit.ready.is_set() and qkv.dtype == torch.float32:
            q = jit.rope(qkv, qk_weight, cos, sin, self.q_norm.variance_epsilon, self.heads, keys[0], values[0], n)
            return jit.attend(q.view(self.heads[1], -1, self.head_dim), keys[0], values[0], n + 1, self.scaling)
        qkv = qkv.view(1, -1, 1, self.head_dim)
        qk, v = qkv.split([self.heads[0] + self.heads[1], self.heads[2]], 1)
        qk = F.rms_norm(qk, (self.head_dim,), None, self.q_norm.variance_epsilon) * qk_weight
        q, k = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, -1), sin).split(self.heads[:2], 1)
        keys[:, :, n:n + 1] = k
        values[:, :, n:n + 1] = v
        queries = q.view(self.heads[1], -1, self.head_dim)  # key/value heads x the query heads that share each
        # The cache as the left operand, one pass over it ((positions x head_dim) @ (head_dim x queries)), beats
        # SDPA's kernel once the cache is out of CPU caches (docs/performance.md).
        weights = torch.matmul(keys[0, :, :n + 1].to(q.dtype), queries.transpose(1, 2)).mul_(self.scaling).softmax(1)
        return torch.matmul(weights.transpose(1, 2), values[0, :, :n + 1].to(q.dtype))

    def qk_weight(self) -> torch.Tensor:
        return torch.cat([self.q_norm.weight.expand(self.heads[0], 1, -1), self.k_norm.weight.expand(self.heads[1], 1, -1)])


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen's RMSNorm as one fused op: its module's five small ops cost ~10% of a quantized 2B step (and torch's
    fused op is itself eight: qvl.engine.jit's kernel, once warm, where the activations are float32)."""
    if jit.ready.is_set() and x.dtype == norm.weight.dtype == torch.float32:
        return jit.norm(x, norm.weight, norm.variance_epsilon)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class RMSNorm(Qwen3VLTextRMSNorm):
    """transformers' text RMSNorm (fuse() gives its modules this class: same parameters, same names), a prompt's rows
    through jit's kernel where they and the weight are float32: its six ops took ~80 ms of the 2B's first token."""

    def forward(self, hidden_states):
        if jit.ready.is_set() and hidden_states.dtype == self.weight.dtype == torch.float32:
            return jit.norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class MLP(nn.Module):
    """Qwen3-VL's gated MLP with one gate/up linear."""

    def __init__(self, hf: nn.Module, copy: bool):
        super().__init__()
        self.sizes = [hf.gate_proj.out_features, hf.up_proj.out_features]
        self.gate_up_proj = _linear([hf.gate_proj, hf.up_proj], copy)
        self.down_proj, self.act_fn = hf.down_proj, hf.act_fn

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.sizes, -1)
        return self.down_proj(self.act_fn(gate) * up)


# oneDNN computes bf16 linears on x86 CPUs with AVX-512 or AMX; elsewhere its fused linear refuses bf16, and on Arm
# (another oneDNN backend) it was never run.
FUSES_BF16 = (not cpu.arm() and torch.backends.mkldnn.is_available()
              and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(tanh) of a bf16 linear, applied by oneDNN to each tile's fp32 sums as it writes them."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "tanh")


class VisionMLP(nn.Module):
    """The vision tower's MLP; in a tower that computes in bf16, its gelu is part of the first linear (linear_gelu, or
    oneDNN's int8 kernel in an int8 tower: Int8Linear.bf16_rows): 7.8 ms a block against 10.6 for the linear and then
    torch's gelu (the 2B's 1200 patches, AMX Xeon), taken from the fp32 sums rather than their bf16 rounding."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.linear_fc1, self.linear_fc2, self.act_fn = hf.linear_fc1, hf.linear_fc2, hf.act_fn
        self.fused = FUSES_BF16 and isinstance(hf.act_fn, GELUTanh)

    def forward(self, x):
        fc1 = self.linear_fc1
        if self.fused and x.dtype == torch.bfloat16:
            if isinstance(fc1, quant.Int8Linear):  # an int8 tower's: oneDNN's int8 kernel applies it
                return self.linear_fc2(fc1.bf16_rows(x, gelu=True))
            weight = fc1.bf16_weight() if isinstance(fc1, quant.Int8WeightOnly) else fc1.weight
            return self.linear_fc2(linear_gelu(x, weight, fc1.bias))
        return self.linear_fc2(self.act_fn(fc1(x)))


class VisionAttention(nn.Module):
    """The vision tower's attention, its q and k rotated and laid out for attention by one kernel once jit is warm
    (jit.vision_rope, bit for bit transformers' rotation): transformers' ~14 ops a block took 3-8 ms of the 2B's 1200
    patches in a bf16 tower on an AMX Xeon, the kernel 1.2. Images attend each over its own patches (cu_seqlens), as
    in transformers' forward without flash attention."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.qkv, self.proj, self.num_heads, self.scaling = hf.qkv, hf.proj, hf.num_heads, hf.scaling
        self.config, self.num_key_value_groups, self.is_causal = hf.config, 1, False

    def forward(self, hidden_states, cu_seqlens, position_embeddings, **kwargs):
        positions = hidden_states.shape[0]
        qkv, (cos, sin) = self.qkv(hidden_states).view(positions, 3, self.num_heads, -1), position_embeddings
        if jit.ready.is_set():
            q, k, v = jit.vision_rope(qkv, cos, sin)
        else:
            q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
            q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outs = [attend(self, *image, attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False)[0]
                for image in zip(*(t.split(lengths, 2) for t in (q, k, v)))]
        return self.proj(torch.cat(outs, 1).reshape(positions, -1))


class PatchEmbed(nn.Module):
    """The vision tower's patch embedding as the matmul it is: its Conv3d's kernel is its stride, so each patch (a row
    of pixel values, flattened as the kernel is) meets the kernel once. torch's conv took 68 ms in fp32 and 136 ms in
    bf16 for the 2B's 1200 patches on an AMX Xeon, the matmul 10 and 1.7."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.proj, self.embed_dim = embed.proj, embed.embed_dim  # the conv stays, so the checkpoint's names do

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(hidden_states.to(weight.dtype), weight.view(self.embed_dim, -1), self.proj.bias)


def fuse(model: nn.Module, copy: bool = True):
    """Give every text decoder layer its fused attention and MLP, the text model's norms jit's kernel (RMSNorm), and the
    vision tower its attention, its MLP and its patch embedding as a matmul; copy=False for a skeleton a loader
    fills."""
    for module in model.model.language_model.modules():
        if type(module) is Qwen3VLTextRMSNorm:
            module.__class__ = RMSNorm
    for layer in model.model.language_model.layers:
        layer.self_attn = Attention(layer.self_attn, copy)
        layer.mlp = MLP(layer.mlp, copy)
    for block in model.model.visual.blocks:
        block.attn, block.mlp = VisionAttention(block.attn), VisionMLP(block.mlp)
    model.model.visual.patch_embed = PatchEmbed(model.model.visual.patch_embed)


def set_dtypes(model: nn.Module, prompt: torch.dtype | None = None, cache: torch.dtype | None = None):
    """Have the text decoder attend over a prompt in `prompt` and keep its keys and values in `cache` (None: the
    activations' dtype). A prompt in bf16 where the CPU's matrix units compute it: the 2B's standard prompt attended
    in 0.09 s instead of 0.18 in fp32 on an AMX Xeon, at a logit SQNR of 22.96 dB against 22.89 (docs/quantization.md,
    "The vision tower"). A cache in bf16 holds a conversation in half the memory, and a decode step reads half the
    bytes of it (docs/quantization.md, "The KV cache"); a prompt then attends over its keys as kept, so a reused
    cache answers as a cold one."""
    for layer in model.model.language_model.layers:
        layer.self_attn.prompt_dtype, layer.self_attn.cache_dtype = prompt, cache


def parts(name: str) -> list[str]:
    """The checkpoint's linears whose rows make up the linear at name, in order (itself, unless fused)."""
    parent, _, child = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED.get(child, (child,))]


def sources(name: str, module: nn.Linear) -> list[str]:
    """The checkpoint's names for what fills the linear at name (its own parameters, or its parts')."""
    params = [p for p, v in module._parameters.items() if v is not None]
    return [f"{part}.{p}" for part in parts(name) for p in params]


def place(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Copy a checkpoint tensor that is part of a fused linear into its rows and return that linear's name; None for
    any other tensor."""
    module_name, _, param = name.rpartition(".")
    parent, _, child = module_name.rpartition(".")
    if child not in PART:
        return None
    fused, index = PART[child]
    owner = model.get_submodule(parent)
    linear = getattr(owner, fused)
    if getattr(linear, param).dtype != tensor.dtype:  # the skeleton is bf16; a checkpoint may hold another dtype
        setattr(linear, param, nn.Parameter(torch.empty(getattr(linear, param).shape, dtype=tensor.dtype),
                                            requires_grad=False))
    start = sum(owner.sizes[:index])
    getattr(linear, param).data[start:start + owner.sizes[index]] = tensor
    return f"{parent}.{fused}"


class Decoder:
    """Decode steps after a prefill: keys and values in buffers with room for `room` more positions, each step at
    its place in the cache plus delta, the prompt's M-RoPE delta.

    The prefill's cache is moved into the buffers a layer at a time (its layers then view them), and close() hands
    it back as an exact-size copy holding every decoded position: what the cache would hold had transformers' forward
    decoded, for conversation memory to keep. Both are one block of their own pages (heap.mapped), so the room an
    answer does not use is never resident, and what a conversation keeps leaves no hole in the heap when it goes.
    """

    def __init__(self, model: nn.Module, cache: DynamicCache, room: int, delta: int):
        self.model, self.text, self.cache = model, model.model.language_model, cache
        self.prompt = self.n = cache.get_seq_length()
        self.delta = delta
        self.qk_weights = [layer.self_attn.qk_weight() for layer in self.text.layers]
        self.cos, self.sin = _rotation(self.text, self.n + delta, room)
        # The pairs are read a layer at a time, so each layer's prefill tensors are freed once moved.
        self.keys, self.values = self._move(((layer.keys, layer.values) for layer in cache.layers), self.n + room)
        self.vnni = _vnni_step(self)

    def _move(self, pairs, size: int) -> tuple[list, list]:
        """Copy each layer's (keys, values) in pairs, all their positions, into one new block with room for size;
        the cache's layers then view the block. The block's keys and values, per layer."""
        like = self.cache.layers[0].keys
        block = heap.mapped((len(self.cache.layers), 2, *like.shape[:2], size, like.shape[3]), like.dtype)
        for layer, (keys, values), (old_keys, old_values) in zip(self.cache.layers, block, pairs):
            n = old_keys.shape[2]
            keys[:, :, :n], values[:, :, :n] = old_keys, old_values
            layer.keys, layer.values = keys[:, :, :n], values[:, :, :n]
        return list(block[:, 0]), list(block[:, 1])

    def step(self, token: int) -> torch.Tensor:
        """The next position's logits (one vocabulary-sized row) after feeding token."""
        return step([self], [token])[0]

    def rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (1 x 1 x head_dim) for the next position, from the answer's tables."""
        at = self.n - self.prompt
        return self.cos[:, at:at + 1], self.sin[:, at:at + 1]

    def close(self, keep_decoded: bool = True, fed: int | None = None):
        """Hand the cache back with every position (or, keep_decoded=False, the prompt's alone; fed: only the first
        fed decoded ones)."""
        if self.keys is not None:
            n = (self.n if fed is None else min(self.n, self.prompt + fed)) if keep_decoded else self.prompt
            self._move([(keys[:, :, :n], values[:, :, :n]) for keys, values in zip(self.keys, self.values)], n)
            # The buffers' block is unmapped with its last view: vnni's layers hold views too.
            self.keys = self.values = self.vnni = None


def _vnni_tables(layer: nn.Module) -> tuple | None:
    """The tables of a decoder layer's four linears where vnni's kernels read them all (w8a14 on oneDNN's weights,
    no bias)."""
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if not all(isinstance(m, quant.Int8Linear) and m.bias is None for m in linears):
        return None
    tables = tuple(m.vnni_table() for m in linears)
    return None if None in tables else tables


def _vnni_step(decoder: Decoder) -> tuple | None:
    """What vnni.decode reads through decoder's answer (every text decoder layer, then the token table, final norm
    and head: vnni.layers' and vnni.ends'), where vnni's kernels read every linear of each layer and the head: then
    one call computes a step. None where not."""
    text, head = decoder.text, decoder.model.lm_head
    if not (isinstance(text.embed_tokens, quant.Bf16Embedding) and isinstance(head, quant.Int8Linear)
            and head.bias is None and (head_table := head.vnni_table()) is not None):
        return None
    prepared = []
    for layer, qk_weight, keys, values in zip(text.layers, decoder.qk_weights, decoder.keys, decoder.values):
        if (tables := _vnni_tables(layer)) is None:
            return None
        attention, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
        eps = (*(norm.variance_epsilon for norm in norms), attention.q_norm.variance_epsilon)
        prepared.append(vnni.prepare(tuple(norm.weight for norm in norms), eps, attention.heads[:2], attention.scaling,
                                     qk_weight, keys[0], values[0], tables))
    return vnni.layers(prepared), vnni.ends(text.embed_tokens.weight, text.norm.weight, text.norm.variance_epsilon,
                                            head_table)


def _rotation(text: nn.Module, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The M-RoPE cos and sin (float32, 1 x count x head_dim) of text positions start.. (a text token's three sections
    share its position), sin's first half negated (Attention.step rotates with a roll): an answer's, made once, where
    each step's took ~0.25 ms of small ops. The same numbers: each is computed elementwise from its own position."""
    cos, sin = text.rotary_emb(torch.empty(0), torch.arange(start, start + count).view(1, 1, -1))
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], -1)


@torch.inference_mode()
def step(decoders: list[Decoder], tokens: list[int]) -> torch.Tensor:
    """Each decoder's next position's logits (B x vocabulary) after feeding it its token: the linears take the B rows
    together, one pass over the weights for all of them, and each row attends over its own cache at its own place.
    The decoders share one model."""
    first = decoders[0]
    text = first.text
    rotations = [d.rotation() for d in decoders]
    n = [d.n for d in decoders]
    # The whole step in one call, unless the kernels were switched off since the decoder was made.
    if len(decoders) == 1 and first.vnni is not None and vnni.ready and jit.ready.is_set():
        logits = vnni.decode(tokens[0], *rotations[0], n[0], *first.vnni)
        first.n += 1
        return logits
    x = text.embed_tokens(torch.tensor(tokens).view(-1, 1))
    cos, sin = rotations[0] if len(decoders) == 1 else (torch.cat(rows) for rows in zip(*rotations))
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # as rotary_emb gives them: a bf16 model's in bf16
    for i, (layer, qk_weight) in enumerate(zip(text.layers, first.qk_weights)):
        keys, values = [d.keys[i] for d in decoders], [d.values[i] for d in decoders]
        x = x + layer.self_attn.step(_norm(layer.input_layernorm, x), cos, sin, keys, values, n, qk_weight)
        x = x + layer.mlp(_norm(layer.post_attention_layernorm, x))
    for d in decoders:
        d.n += 1
    return first.model.lm_head(_norm(text.norm, x))[:, -1]
