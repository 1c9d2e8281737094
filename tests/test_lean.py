"""The lean decode step and the fused linears (qvl.engine.lean) compute what transformers' own model computes."""
from collections import Counter
import threading

import pytest
import torch
from torch import nn
from transformers import AutoModelForImageTextToText, DynamicCache
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import checkpoint, generate, heap, jit, kv, lean, modes, vnni
from test_engine import picture

STEPS = 40
# fp32 on the same inputs; the fused q/k/v and gate/up matmuls may sum in another order than three separate ones.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def plain(tiny_dir):
    """transformers' own Qwen3-VL, its layers as they come: the reference."""
    return AutoModelForImageTextToText.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture
def prompt(engine):
    """A prompt with an image, so that decode positions depend on its M-RoPE delta."""
    inputs, _ = engine._inputs([Turn("user", "What is in this picture?", (picture(),))], settings.GenParams())
    return inputs


def _spy(monkeypatch) -> list:
    """Record each lean attention step: proof that the lean path, not transformers' forward, decoded."""
    calls, step = [], lean.Attention.step

    def recorded(self, *args):
        calls.append(self.layer_idx)
        return step(self, *args)

    monkeypatch.setattr(lean.Attention, "step", recorded)
    return calls


def test_every_text_layer_is_fused_and_the_vision_tower_only_embeds_its_patches_as_a_matmul(engine):
    model = engine.model
    for layer in model.model.language_model.layers:
        assert isinstance(layer.self_attn, lean.Attention) and isinstance(layer.mlp, lean.MLP)
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    assert {"qkv_proj", "gate_up_proj"} <= names and not {"q_proj", "k_proj", "gate_proj", "up_proj"} & names
    assert any(isinstance(m, nn.Linear) for m in model.model.visual.modules())
    assert isinstance(model.model.visual.patch_embed, lean.PatchEmbed)
    assert "model.visual.patch_embed.proj.weight" in model.state_dict()  # the checkpoint's names stay


def test_the_vision_tower_makes_transformers_image_features_with_its_patches_embedded_and_rotated_its_own_way(
        engine, plain, kernels):
    """fp32, two images of different sizes, each attending over its own patches: what the tower makes of them,
    deepstack features included, is transformers' own (its conv, its rotation), within the order a matmul sums in.
    Once the kernels are warm, each block's q and k are rotated by one (jit.vision_rope)."""
    assert not isinstance(plain.model.visual.patch_embed, lean.PatchEmbed)
    assert all(isinstance(block.attn, lean.VisionAttention) for block in engine.model.model.visual.blocks)
    images = (picture(), picture(200, 330, (10, 160, 40)))
    inputs, _ = engine._inputs([Turn("user", "Which is greener?", images)], settings.GenParams())
    assert len(inputs["image_grid_thw"]) == 2
    with torch.inference_mode():
        ours, theirs = (model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
                        for model in (engine.model, plain))
    for mine, want in zip([ours.pooler_output, *ours.deepstack_features],
                          [theirs.pooler_output, *theirs.deepstack_features]):
        assert torch.allclose(mine, want, atol=TOLERANCE, rtol=TOLERANCE)
    blocks = len(engine.model.model.visual.blocks)
    assert kernels[1] == (["vision_rope"] * blocks if kernels[0] == "jit" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vision_rotation_kernel_is_transformers_rotation_bit_for_bit(tmp_path, dtype):
    """In a bf16 tower too: transformers rotates in float32 and rounds once to bf16, as the kernel does."""
    assert jit.warm(str(tmp_path))
    torch.manual_seed(0)
    qkv = torch.randn(300, 3, 4, 16).to(dtype)
    angles = torch.randn(300, 8) * 30
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    ours = jit.vision_rope(qkv, cos, sin)
    for mine, want in zip(ours, (q, k, v)):
        assert mine.dtype == dtype and mine.is_contiguous()
        assert torch.equal(mine, want.transpose(0, 1).unsqueeze(0))


def test_lean_steps_give_transformers_logits_position_by_position(engine, plain, prompt, kernels, monkeypatch):
    """On torch's ops and on the numba kernels (qvl.engine.jit) alike."""
    tokens = torch.randint(0, 256, (STEPS,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = _spy(monkeypatch)
    with torch.inference_mode():
        position_ids, delta = generate.positions(engine.model, prompt)
        assert delta != 0  # the image moved text positions
        ours = generate._forward(engine.model, **prompt, position_ids=position_ids)
        reference = plain(**prompt, use_cache=True, logits_to_keep=1)
        expected = reference.logits[0, -1]  # the prompt's own: its norms on jit's kernel where it is on
        assert (ours.logits[0, -1] - expected).abs().max() <= TOLERANCE * expected.abs().max()
        decoder = lean.Decoder(engine.model, ours.cache, STEPS, delta)
        for i, token in enumerate(tokens):
            logits = decoder.step(token)
            reference = plain(input_ids=torch.tensor([[token]]), cache=reference.cache, use_cache=True,
                              logits_to_keep=1)
            expected = reference.logits[0, -1]
            assert (logits - expected).abs().max() <= TOLERANCE * expected.abs().max(), f"step {i}"
            assert logits.argmax() == expected.argmax()
    layers = len(engine.model.model.language_model.layers)
    assert len(calls) == STEPS * layers
    if kernels[0] == "jit":  # each layer's q/k/v into place and its attention, every norm (two a layer, the final),
        # and the prompt's: its norms, and each layer's q and k normed and rotated
        assert Counter(kernels[1]) == {"rope": STEPS * layers, "attend": STEPS * layers,
                                       "norm": STEPS * (2 * layers + 1) + 2 * layers + 1, "prompt_rope": layers,
                                       "vision_rope": len(engine.model.model.visual.blocks)}  # the prompt's image
    else:
        assert kernels[1] == []


class _RoundedCache(DynamicCache):
    """transformers' cache with each key and value rounded to bf16 as it is stored (and kept in fp32)."""

    def update(self, keys, values, layer_idx, *args, **kwargs):
        return super().update(keys.bfloat16().float(), values.bfloat16().float(), layer_idx, *args, **kwargs)


def test_a_bf16_cache_decodes_as_transformers_with_its_keys_and_values_rounded_to_bf16(engine, plain, prompt, kernels,
                                                                                       monkeypatch):
    """--kv-dtype bf16 (a quantized mode's default): the prompt keeps its keys and values in bf16 and attends over them
    as kept, and every decode step writes and reads bf16 (the numba kernels its bits): transformers' model with each
    key and value rounded to bf16 as it is stored."""
    tokens = torch.randint(0, 256, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    calls = _spy(monkeypatch)
    lean.set_dtypes(engine.model, cache=torch.bfloat16)
    try:
        with torch.inference_mode():
            position_ids, delta = generate.positions(engine.model, prompt)
            ours = generate._forward(engine.model, **prompt, position_ids=position_ids)
            assert {t.dtype for layer in ours.cache.layers for t in (layer.keys, layer.values)} == {torch.bfloat16}
            reference = plain(**prompt, cache=_RoundedCache(config=plain.config), use_cache=True, logits_to_keep=1)
            decoder, worst = lean.Decoder(engine.model, ours.cache, STEPS, delta), 0.0
            for token in tokens:
                logits = decoder.step(token)
                reference = plain(input_ids=torch.tensor([[token]]), cache=reference.cache, use_cache=True,
                                  logits_to_keep=1)
                expected = reference.logits[0, -1]
                worst = max(worst, ((logits - expected).abs().max() / expected.abs().max()).item())
                assert logits.argmax() == expected.argmax()
            assert decoder.keys[0].dtype == decoder.values[0].dtype == torch.bfloat16
    finally:
        lean.set_dtypes(engine.model)
    assert worst <= TOLERANCE, worst
    layers = len(engine.model.model.language_model.layers)
    assert len(calls) == STEPS * layers
    if kernels[0] == "jit":
        assert Counter(kernels[1])["rope"] == Counter(kernels[1])["attend"] == STEPS * layers
    else:
        assert kernels[1] == []


def test_decode_steps_take_the_delta_they_are_given_never_the_one_transformers_keeps(engine, plain, prompt,
                                                                                      monkeypatch):
    """transformers keeps the last prompt's M-RoPE delta on the model object, whichever conversation that was: the
    decoder ignores it and steps at the delta it is given, right or wrong."""
    position_ids, delta = generate.positions(engine.model, prompt)
    with torch.inference_mode():
        expected = plain(input_ids=torch.tensor([[7]]), cache=plain(**prompt, use_cache=True).cache).logits[0, -1]
        stepped = {}
        for given, kept in ((delta, delta + 5), (delta + 5, delta)):
            monkeypatch.setattr(engine.model.model, "rope_deltas", torch.tensor([[kept]]))
            out = generate._forward(engine.model, **prompt, position_ids=position_ids)
            stepped[given] = lean.Decoder(engine.model, out.cache, 1, given).step(7)
    assert (stepped[delta] - expected).abs().max() <= TOLERANCE * expected.abs().max()
    assert (stepped[delta + 5] - expected).abs().max() > 100 * TOLERANCE * expected.abs().max()


def test_a_sampled_answer_and_the_cache_it_leaves_match_transformers(engine, plain, prompt, kernels, monkeypatch):
    """Sampling (so that the tiny model's answer varies), same seed: the same tokens, and close() leaves the cache
    that transformers' decoding leaves, which conversation memory keeps for the follow-up; with the numba kernels
    too."""
    params = settings.GenParams(greedy=False, temperature=1.0, top_k=0, top_p=1.0, seed=3, max_new_tokens=STEPS,
                                min_new_tokens=STEPS)
    calls = _spy(monkeypatch)
    ids = list(generate.stream(engine.model, prompt, params, threading.Event()))
    assert len(set(ids)) > 5 and len(calls) == (STEPS - 1) * len(engine.model.model.language_model.layers)
    if kernels[0] == "jit":
        assert kernels[1].count("rope") == kernels[1].count("attend") == len(calls)
    else:
        assert kernels[1] == []

    rng, expected = torch.Generator().manual_seed(params.seed), []
    with torch.inference_mode():
        out = plain(**prompt, use_cache=True, logits_to_keep=1)
        for _ in range(STEPS):
            expected.append(generate._pick(out.logits[0, -1], params, rng))
            if len(expected) < STEPS:
                out = plain(input_ids=torch.tensor([expected[-1]]).view(1, 1), cache=out.cache, use_cache=True,
                            logits_to_keep=1)
    assert ids == expected

    cache, blocks, mapped = DynamicCache(config=engine.model.config), [], heap.mapped
    monkeypatch.setattr(heap, "mapped", lambda shape, dtype: blocks.append(shape[-2]) or mapped(shape, dtype))
    for _ in generate.stream(engine.model, dict(prompt, cache=cache), params, threading.Event()):
        pass
    n = prompt["input_ids"].shape[1]
    assert cache.get_seq_length() == out.cache.get_seq_length() == n + STEPS - 1
    assert blocks == [n + STEPS, n + STEPS - 1]  # the answer's buffers, then what it keeps: outside malloc's heap
    for ours, theirs in zip(cache.layers, out.cache.layers):
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    kept = {t.untyped_storage().data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)}
    assert len(kept) == 1 and cache.layers[0].keys.untyped_storage().nbytes() == kv.nbytes(cache)  # no spare room


def test_a_stream_closed_early_leaves_only_the_tokens_fed_back(engine, prompt):
    params = settings.GenParams(greedy=True, max_new_tokens=STEPS, min_new_tokens=STEPS)
    cache = DynamicCache(config=engine.model.config)
    tokens = generate.stream(engine.model, dict(prompt, cache=cache), params, threading.Event())
    taken = [next(tokens) for _ in range(5)]
    tokens.close()
    assert len(taken) == 5 and cache.get_seq_length() == prompt["input_ids"].shape[1] + 4


def test_the_first_token_does_not_wait_for_the_decoder_and_a_one_token_answer_still_keeps_its_prompt(
        engine, prompt, monkeypatch):
    made, init = [], lean.Decoder.__init__
    monkeypatch.setattr(lean.Decoder, "__init__", lambda self, *args: made.append(1) or init(self, *args))
    length = prompt["input_ids"].shape[1]
    cache = DynamicCache(config=engine.model.config)
    params = settings.GenParams(greedy=True, max_new_tokens=3, min_new_tokens=3)
    tokens = generate.stream(engine.model, dict(prompt, cache=cache), params, threading.Event())
    next(tokens)
    assert made == []  # prefilled and picked: the cache is moved into the answer's buffers for the first step
    assert len(list(tokens)) == 2 and made == [1] and cache.get_seq_length() == length + 2
    cache = DynamicCache(config=engine.model.config)
    params = settings.GenParams(greedy=True, max_new_tokens=1)
    assert len(list(generate.stream(engine.model, dict(prompt, cache=cache), params, threading.Event()))) == 1
    assert made == [1, 1] and cache.get_seq_length() == length
    assert cache.layers[0].keys.untyped_storage().nbytes() == kv.nbytes(cache)  # kept in pages of its own, no room


@pytest.mark.parametrize("kind", ["int8", "int4", "w8a16", "w8a14"])
def test_fused_quantized_linears_are_exactly_the_separate_ones(kind):
    """Weights are quantized row by row and the input once, so fusing changes no output bit."""
    torch.manual_seed(0)
    parts = [nn.Linear(256, n, bias=False).to(torch.bfloat16) for n in (128, 64, 64)]
    fused = lean._linear(parts, copy=True)
    convert = {"int8": checkpoint._int8, "int4": checkpoint._int4, "w8a16": checkpoint._w8a16,
               "w8a14": checkpoint._w8a14}[kind]
    separate = [convert(f"model.language_model.layers.0.self_attn.{p}", linear)
                for p, linear in zip(("q_proj", "k_proj", "v_proj"), parts)]
    together = convert("model.language_model.layers.0.self_attn.qkv_proj", fused)
    for linear in [*separate, together]:
        linear.two_part = kind == "w8a14"
    for rows in (1, 16, 40):  # decode rows (int4's and w8a16's own kernels), prefill rows (int4's int8 twin, bf16 GEMM)
        x = torch.randn(rows, 256)
        assert torch.equal(together(x), torch.cat([linear(x) for linear in separate], -1))


@pytest.mark.parametrize("kernels", ["vnni"], indirect=True)
def test_a_batchs_rows_through_vnnis_kernel_decode_as_through_onednns_call(onednn, kernels, tiny_dir, monkeypatch):
    """Up to vnni.ROWS answers decoded together, each at its own place in its own cache: every linear's rows in one
    call of qvl's kernel (each block's weights read once for them all), the logits of oneDNN's own call within float
    rounding (the loud channels' sums; the whole-number sums are exact)."""
    model = checkpoint.load_model(str(tiny_dir), "w8a14")
    layers = len(model.model.language_model.layers)
    ids = torch.randint(0, 256, (vnni.ROWS, 30), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 256, (STEPS, vnni.ROWS), generator=torch.Generator().manual_seed(1)).tolist()

    def decoded(rows: int) -> torch.Tensor:
        monkeypatch.setattr(vnni, "ROWS", rows)
        with torch.inference_mode():  # prompts of different lengths: each row attends at its own place
            caches = [generate._forward(model, input_ids=ids[i:i + 1, :10 + 5 * i]).cache for i in range(len(ids))]
            decoders = [lean.Decoder(model, cache, STEPS, 0) for cache in caches]
            return torch.stack([lean.step(decoders, step) for step in tokens])

    kernels[1].clear()
    together = decoded(vnni.ROWS)
    # Each step's four linears a layer and the head, and each prompt's last row through the head.
    assert kernels[1].count("linear") == STEPS * (4 * layers + 1) + len(ids) and "decode" not in kernels[1]
    kernels[1].clear()
    onednn_call = decoded(1)
    assert kernels[1].count("linear") == len(ids)  # the prompts' heads alone
    assert (together - onednn_call).abs().max() <= TOLERANCE * onednn_call.abs().max()


@pytest.mark.parametrize("kernels", ["vnni"], indirect=True)
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_vnni_call_decodes_as_its_ops_one_by_one_and_no_farther_from_fp32(
        onednn, kernels, tiny_dir, cache, monkeypatch):
    """Where qvl's kernels read every linear of every layer and the head (w8a14 on oneDNN's weights), one call
    computes a decode step (vnni.decode: the token's row, the layers, the final norm and the head): the logits of
    their ops one at a time within float rounding (silu's exp, the loud channels' sums), over a float32 and a bf16
    cache, in a layer with weights in two parts and one without, a linear with loud channels apart, norms of different
    epsilons; and no farther from fp32's logits."""
    monkeypatch.setattr(modes, "TWO_PART_LAYERS", 1)  # the tiny model's first layer in two parts, its second not
    model, reference = checkpoint.load_model(str(tiny_dir), "w8a14"), checkpoint.load_model(str(tiny_dir), "fp32")
    layers = model.model.language_model.layers
    assert [layer.mlp.down_proj.weight_parts for layer in layers] == [2, 1]
    down = layers[1].mlp.down_proj
    down.set_apart(torch.tensor([5, 40]), torch.randn(2, down.out_features) * 0.1)
    for m in (model, reference):  # each norm's own epsilon, not the first one's
        m.model.language_model.layers[1].post_attention_layernorm.variance_epsilon = 0.5
    lean.set_dtypes(model, cache=cache)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 256, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    one_by_one = lean._vnni_step

    def decoded(m, fused: bool = True) -> torch.Tensor:
        monkeypatch.setattr(lean, "_vnni_step", one_by_one if fused else lambda decoder: None)
        with torch.inference_mode():
            decoder = lean.Decoder(m, generate._forward(m, input_ids=ids).cache, STEPS, 0)
            return torch.stack([decoder.step(token) for token in tokens])

    kernels[1].clear()
    fused = decoded(model)
    # Every step in one call, its attention and head inside it: the prompt's last row alone goes through the head.
    assert kernels[1].count("decode") == STEPS and "attend" not in kernels[1] and kernels[1].count("linear") == 1
    kernels[1].clear()
    separate = decoded(model, fused=False)
    assert "decode" not in kernels[1] and kernels[1].count("attend") == STEPS * len(layers)
    assert kernels[1].count("linear") == 1 + STEPS * (4 * len(layers) + 1)
    assert (fused - separate).abs().max() <= TOLERANCE * separate.abs().max()
    exact = decoded(reference)
    assert (fused - exact).norm() <= 1.01 * (separate - exact).norm()


def test_an_answers_rotation_is_made_once_with_the_numbers_each_step_would_make(engine, prompt, monkeypatch):
    """lean.Decoder's cos and sin tables: at each step, rotary_emb's for the step's position (its place in the cache
    plus the prompt's M-RoPE delta, all three sections alike), sin's first half negated as Attention.step rotates, bit
    for bit; and the steps compute no rotation of their own."""
    position_ids, delta = generate.positions(engine.model, prompt)
    text = engine.model.model.language_model
    with torch.inference_mode():
        out = generate._forward(engine.model, **prompt, position_ids=position_ids)
        decoder = lean.Decoder(engine.model, out.cache, STEPS, delta)
        calls, rotary = [], text.rotary_emb.forward
        monkeypatch.setattr(text.rotary_emb, "forward", lambda *args: calls.append(args) or rotary(*args))
        for step in range(STEPS):
            places = torch.full((3, 1, 1), decoder.n + delta)
            cos, sin = rotary(torch.empty(0), places)
            half = sin.shape[-1] // 2
            assert torch.equal(decoder.rotation()[0], cos), step
            assert torch.equal(decoder.rotation()[1], torch.cat([-sin[..., :half], sin[..., half:]], -1)), step
            decoder.step(7)
        assert calls == [] and decoder.n == decoder.prompt + STEPS
        decoder.close()
