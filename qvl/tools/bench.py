"""The speed ladder: each configuration answers the standard request through the real Engine, in a fresh process.

    python -m qvl.bench --random-weights [--rows fp32,int4,auto] [--runs 3] [--json FILE]
    python -m qvl.bench --random-weights --rows auto --scenarios follow-up,seen-image,regenerate
    python -m qvl.bench --random-weights --rows auto,auto-warm --runs 1    # first start, then a second one
    python -m qvl.bench --random-weights --outliers --rows fp32,bf16,auto --runs 1   # weights with activation outliers
    python -m qvl.bench --model /path/to/Qwen3-VL-2B-Instruct
    python -m qvl.bench --kernels    # one linear's decode row and prompt in each kernel: what auto's choice rests on
    python -m qvl.bench --random-weights --linears    # fidelity of each way to compute the linears, one process
    python -m qvl.bench --random-weights --rows auto --concurrent 1,4,8    # a crowd: answers decoded together

Standard request: one 640x480 photo-like image (300 image tokens), a one-sentence question, 64 new tokens forced
(greedy, min_new_tokens = max_new_tokens = 64), one warm-up, then --runs timed runs (medians reported). Fidelity is
measured teacher-forced over the fp32 row's answer, through the prefill and the decode steps as an answer is made, so
the `fp32` row must run first for the other rows to get it.
Random weights give near-uniform logits: their top-1 agreement says little, and real-weight quality is only
measured when real weights are given with --model. --outliers plants the activation outliers of real checkpoints
(a few hidden channels 32-64x the rest in every text linear's input, which a per-tensor activation scale punishes)
into the random weights, so that fidelity shows what quantization costs where such outliers exist (plant_outliers
says how). Each timed run starts with nothing kept (Engine.forget), as a first visit does.

--concurrent serves a crowd: at each level that many standard requests arrive at once, then one a second, through
one engine with --batch (default: the largest level, at most 8), and again through --batch 1 for the levels up to 4
arriving at once (what answering one at a time costs them), each request prefilled in full (nothing kept).

Scenarios measure conversation memory: each request's time to first token after its set-up (the standard request
and its answer), then the same request cold, with everything kept forgotten, in the same process.
"""
import argparse
import copy
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import checkpoint, cpu, generate, heap, jit, lean, modelcache, modes, quant, tiny, vnni
from qvl.engine.local import Engine

CONFIG = Path(__file__).with_name("qwen3-vl-2b-instruct.config.json")
RANDOM_DIR = Path(os.path.expanduser("~")) / ".cache" / "qvl" / "random-2b-v1"
OUTLIER_DIR = RANDOM_DIR.with_name("random-2b-outliers-v1")  # new name whenever plant_outliers() changes
OUTLIER_FACTORS = (32.0, 64.0)  # planted channels carry this many times the rest's activations, spread geometrically
NORM_SHARE = 0.5  # of each residual outlier factor (as an exponent), the part that lives in the norm weight
QUESTION = "What is in this photo? Describe the main objects, their colours and where they are."
NEW_TOKENS = 64
FOLLOW_UP = "What is on top?"  # 15 tokens with the random-weight checkpoint's byte tokenizer
SEEN_IMAGE = "Which colours are in this picture?"
SCENARIOS = ("follow-up", "seen-image", "regenerate")
SCENARIO_TOKENS = 16  # each scenario's answer: its logits are where reuse and cold are compared with fp32's
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"

# name -> (quant mode, extra environment, command prefix); each runs in its own process.
ROWS = {
    "fp32": ("fp32", {}, []),
    "bf16": ("bf16", {}, []),
    "bf16+compile": ("bf16", {}, []),
    "int8": ("int8", {}, []),
    "int4": ("int4", {}, []),
    "w8a16": ("w8a16", {}, []),
    "w8a14": ("w8a14", {}, []),
    "auto": ("auto", {}, []),
    # A second start of auto: it reads the converted model the auto row kept, so it must run after that row.
    "auto-warm": ("auto", {}, []),
    "auto+jemalloc": ("auto", {"LD_PRELOAD": JEMALLOC}, []),
    "auto+tcmalloc": ("auto", {"LD_PRELOAD": TCMALLOC}, []),
    "auto+1thread": ("auto", {"QVL_THREADS": "1"}, []),
    "auto+nojit": ("auto", {"QVL_JIT": "0"}, []),  # the decode step on torch's ops alone, without qvl.engine.jit's kernels
    # Each int8 kernel, whichever auto picks here (oneDNN's needs VNNI or AMX).
    "auto+fbgemm": ("auto", {"QVL_INT8_KERNEL": "fbgemm"}, []),
    "auto+onednn": ("auto", {"QVL_INT8_KERNEL": "onednn"}, []),
    "auto+fp32-vision": ("auto", {"QVL_VISION_DTYPE": "fp32"}, []),  # the vision tower in fp32 whatever auto picks
    "auto+fp32-kv": ("auto", {"QVL_KV_DTYPE": "fp32"}, []),  # keys and values in fp32 (auto: bf16)
    "auto+pinned": ("auto", {}, ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))))]),
}
DEFAULT_ROWS = "fp32,bf16,bf16+compile,int8,int4,auto,auto+jemalloc"


def _complete(folder: Path) -> bool:
    return (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists()


def random_checkpoint(out: Path = RANDOM_DIR) -> Path:
    """The exact Qwen3-VL-2B architecture with random bf16 weights, saved once with the tiny byte tokenizer.

    The tiny tokenizer's special tokens sit at ids 256.. rather than 151643..; the config's special ids are moved
    there, which changes no tensor shape and so no compute.
    """
    if _complete(out):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = tiny.build(tmp)
        tiny_config = json.loads((tiny_dir / "config.json").read_text())
        config = json.loads(CONFIG.read_text())
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            config[key] = tiny_config[key]
        for key in ("bos_token_id", "eos_token_id"):
            config["text_config"][key] = tiny_config["text_config"][key]
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration._from_config(Qwen3VLConfig(**config), dtype=torch.bfloat16)
        model.generation_config.eos_token_id = config["text_config"]["eos_token_id"]
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        for path in tiny_dir.iterdir():
            if not path.name.startswith(("model", "config", "generation_config", "qvl_tiny")):
                shutil.copy(path, out / path.name)
    return out


def _geometric(n: int) -> torch.Tensor:
    """n factors spread geometrically over OUTLIER_FACTORS (their geometric mean for one)."""
    low, high = OUTLIER_FACTORS
    return torch.tensor([(low * high) ** 0.5] if n == 1 else [low * (high / low) ** (i / (n - 1)) for i in range(n)])


def _rescale(weight: torch.Tensor, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None):
    """weight <- diag(rows) @ weight @ diag(cols), computed in float32 and rounded once to the weight's dtype."""
    w = weight.data.float()
    if rows is not None:
        w = w * (rows if w.dim() == 1 else rows[:, None])
    if cols is not None:
        w = w * cols
    weight.data = w.to(weight.dtype)


def plant_outliers(model, seed: int = 0, residual: bool = True, norm_share: float = NORM_SHARE) -> dict:
    """Give the text decoder the activation outliers of real checkpoints, in place; return where they were planted.

    Real checkpoints carry, in a few hidden channels, activations 20-100x the rest in the inputs of the linears;
    random weights have none. Three plantings, each a rescaling of weights, with factors spread geometrically over
    OUTLIER_FACTORS (32-64x):

    - q/k/v and gate/up inputs (`residual=False` skips this one): 4 hidden channels of 2048, the same in every
      layer. Part of each factor lives in the residual stream itself: every writer (o_proj, down_proj) has those
      rows scaled up by factor ** (1 - norm_share), so the hidden state and its normalized form carry it; the rest
      in the RMSNorm weights, scaled up by factor ** norm_share there (as real norm weights amplify outlier
      channels). Every reader (q/k/v, gate/up) has those columns scaled down by the whole factor, so its output is
      what it was, up to RMSNorm's per-token scale, which the outliers in the stream grow by ~4%: every norm
      weight is scaled up by that mean growth, and the final norm's weight down by the stream's part on those
      channels, so the tied head reads what it did. Folding the norm weights into the linears leaves the stream's
      part, 5.7-8x. With norm_share 0 the outliers would hold ~80% of each token's RMS, whose per-token scale would
      then swing with their few values: noise of 1% of each output channel's RMS on every linear left the 2B's
      logits at 11.2 dB of SQNR, against 20.6 dB on the plain weights and 20.6 dB with the split. Layer 0 reads the
      token table, which has no outliers and is tied to the head: its input_layernorm weight carries the whole
      factor.
    - o_proj inputs: 4 value channels a layer (v_proj rows up, the matching o_proj columns down, for every query
      head reading that value head) and down_proj inputs: 6 intermediate channels of 6144 a layer (up_proj rows up,
      down_proj columns down). Both are exact: attention is linear in the values and the MLP in up_proj's output.

    The per-token scale makes the fp32 function a slightly different, equally sane one: on the 2B, over a 164-token
    random prompt, its logits are 16.7 dB of SQNR from the plain model's (top-1 agreement 0.76) with the same
    spread. There, against the median channel's RMS, planted channels carry 28-89x in q/k/v and gate/up inputs,
    10-236x in o_proj and 14-194x in down_proj inputs (their channels' natural levels spread more), and the largest
    unplanted channel 4x (q/k/v, gate/up), 7x (o_proj) and 12x (down_proj, where random weights have outliers of
    their own). Factors are float32 and each weight is rounded once. Small models get proportionally fewer
    channels (at least one of each kind).
    """
    text = model.model.language_model
    config = text.config
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    groups = heads // kv_heads
    generator = torch.Generator().manual_seed(seed)

    def pick(n: int, count: int) -> list[int]:
        return sorted(torch.randperm(n, generator=generator)[:count].tolist())

    channels = pick(hidden, max(1, hidden * 4 // 2048))
    factors = _geometric(len(channels))
    in_norm = factors ** norm_share  # in every norm weight
    in_stream = factors / in_norm  # in the residual stream
    rho = float((1 + (in_stream ** 2 - 1).sum() / hidden).sqrt())  # the mean growth of each token's RMS
    planted = {"residual": channels if residual else [], "residual_factors": factors.tolist() if residual else [],
               "in_stream": in_stream.tolist() if residual else [], "rms_scale": rho if residual else 1.0}
    values = [pick(kv_heads * head_dim, max(1, min(4, kv_heads * head_dim // 256))) for _ in text.layers]
    inner = [pick(config.intermediate_size, max(1, min(6, config.intermediate_size // 1024))) for _ in text.layers]
    if residual:
        def on_channels(values, rest=1.0):
            out = torch.full((hidden,), rest)
            out[channels] *= values
            return out
        for i, layer in enumerate(text.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for writer in (attn.o_proj, mlp.down_proj):
                _rescale(writer.weight, rows=on_channels(in_stream))
            for reader in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _rescale(reader.weight, cols=on_channels(1 / factors))
            # Layer 0 reads the token table, which has no outliers: its whole factor lives in the norm weight.
            _rescale(layer.input_layernorm.weight, rows=on_channels(factors) if i == 0 else on_channels(in_norm, rho))
            _rescale(layer.post_attention_layernorm.weight, rows=on_channels(in_norm, rho))
        _rescale(text.norm.weight, rows=on_channels(1 / in_stream, rho))
    for i, layer in enumerate(text.layers):
        attn, mlp = layer.self_attn, layer.mlp
        v_rows, o_cols = torch.ones(kv_heads * head_dim), torch.ones(heads * head_dim)
        for channel, factor in zip(values[i], _geometric(len(values[i]))):
            head, dim = divmod(channel, head_dim)
            v_rows[channel] = factor
            o_cols[[q * head_dim + dim for q in range(head * groups, (head + 1) * groups)]] = 1 / factor
        _rescale(attn.v_proj.weight, rows=v_rows)
        _rescale(attn.o_proj.weight, cols=o_cols)
        up_rows = torch.ones(config.intermediate_size)
        up_rows[inner[i]] = _geometric(len(inner[i]))
        _rescale(mlp.up_proj.weight, rows=up_rows)
        _rescale(mlp.down_proj.weight, cols=1 / up_rows)
    planted.update(values=values, value_factors=_geometric(len(values[0])).tolist(), mlp=inner,
                   mlp_factors=_geometric(len(inner[0])).tolist())
    return planted


def outlier_checkpoint(out: Path = OUTLIER_DIR) -> Path:
    """random_checkpoint() with plant_outliers() applied (its weights planted in float32), saved once beside it."""
    if _complete(out):
        return out
    plain = random_checkpoint()
    model = Qwen3VLForConditionalGeneration.from_pretrained(plain, dtype=torch.float32).eval()
    plant_outliers(model)
    model.to(torch.bfloat16)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for path in plain.iterdir():
        if not path.name.startswith(("model", "config", "generation_config")):
            shutil.copy(path, partial / path.name)
    partial.rename(out)
    return out


def built_apart(build, folder: Path) -> Path:
    """build() (random_checkpoint or outlier_checkpoint, which write folder), in a process of its own if not built.

    Each row's process would otherwise inherit the peak memory of building (Linux carries ru_maxrss across fork and
    exec), and report that as its own peak RSS: 12.8 GB for every row after building the outlier checkpoint in fp32.
    """
    if not _complete(folder):
        subprocess.run([sys.executable, "-c", f"from qvl.tools import bench; bench.{build.__name__}()"], check=True)
    return build()


def photo() -> Image.Image:
    """A deterministic 640x480 image with a photo's structure: a sky gradient, shapes, and sensor noise."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640]
    sky = np.stack([90 + x / 8, 140 + y / 6, 230 - y / 5], -1)
    image = Image.fromarray(np.clip(sky, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 330, 640, 480], fill=(70, 120, 50))
    draw.ellipse([420, 60, 520, 160], fill=(250, 220, 90))
    draw.rectangle([120, 210, 300, 360], fill=(160, 60, 40))
    draw.polygon([(100, 210), (210, 130), (320, 210)], fill=(90, 40, 30))
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 6, (480, 640, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def bandwidth_gb_s(passes: int = 5) -> float:
    """Memory read bandwidth: the fastest of a few ways to read 1 GiB (far beyond any cache) with every thread, best
    of several passes each. One way alone under-reads some CPUs (a sum read an AMX Xeon slower than its decode step
    did, which put decode rows above 100% of their bound). From huge pages where the kernel has them, as the model's
    weights are once settled: on 4 KB pages the same read was 5-10% slower."""
    data = torch.ones(1 << 28)
    heap.huge_pages(data.data_ptr(), data.nbytes)
    matrix, vector = data.view(1 << 14, 1 << 14), torch.ones(1 << 14)
    ways = [data.sum, data.amax, lambda: matrix @ vector]  # a reduction, another, and decode's own matrix-vector read
    best = float("inf")
    for way in ways:
        for _ in range(passes):
            start = time.perf_counter()
            way()
            best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def decode_bytes(model) -> int:
    """Weight bytes one decode step reads: the language model and head, not the vision tower, the token table
    (one row per step) nor int4's prefill twins."""
    modules = [*model.model.language_model.modules(), *model.lm_head.modules()]
    skip = {id(m.prefill) for m in modules if isinstance(m, quant.Int4Linear)}
    total = 0
    for sub in modules:
        if id(sub) in skip or isinstance(sub, (torch.nn.Embedding, quant.Bf16Embedding)):
            continue
        if isinstance(sub, quant.Int8Linear):
            total += len(sub.scale) * sub.in_features  # int8, held in fbgemm's packed form, not as a parameter
        total += sum(t.numel() * t.element_size() for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)])
    return total


def fidelity(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far logits are from the reference's, position by position: SQNR in dB, mean KL(ref || this), top-1."""
    logits, reference = logits.float(), reference.float()
    noise = (logits - reference).pow(2).sum()
    sqnr = 10 * torch.log10(reference.pow(2).sum() / noise).item() if noise > 0 else float("inf")
    ref_logp, logp = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"sqnr_db": sqnr, "kl": kl, "top1_agreement": top1}


def teacher_forced_logits(model, inputs: dict, answer: list[int]) -> torch.Tensor:
    """Logits predicting each answer token, fed the given answer, the way an answer is generated: the prompt's
    prefill gives the first row, a lean decode step each next one. One forward over prompt and answer would measure
    the prefill's kernels only, where int4 decodes with other weights (its int8 twin prefills)."""
    with torch.inference_mode():
        position_ids, delta = generate.positions(model, inputs)
        out = generate._forward(model, **inputs, position_ids=position_ids)
        decoder = lean.Decoder(model, out.cache, len(answer), delta)
        try:
            return torch.stack([out.logits[0, -1], *(decoder.step(token) for token in answer[:-1])]).float()
        finally:
            decoder.close()


def forced_chat(engine, turns: list[Turn], answer: list[int] | None, tokens: int) -> tuple:
    """Engine.chat answering turns, conversation memory and all, with answer's tokens whatever it would pick (None:
    its greedy picks, `tokens` of them): the logits each token was picked from, the Stats and the tokens."""
    n = tokens if answer is None else len(answer)
    params = settings.GenParams(greedy=True, max_new_tokens=n, max_image_tokens=320)  # min_new_tokens masks EOS: -inf
    with generate.forced(answer) as (rows, picked):
        *_, stats = engine.chat(turns, params)
    return torch.stack(rows), stats, picked


def scenarios(engine, names, first: list[int], references: dict | None = None) -> tuple[list[dict], dict]:
    """Each named scenario's request after its set-up (the standard request, answered with the tokens first), then
    the same request cold, everything kept forgotten: both answer the same SCENARIO_TOKENS tokens, so their times to
    first token and their logits compare. references, the fp32 row's {name: {"ids", "logits"}} computed cold, fix
    those tokens and give each way its SQNR against fp32; without them the reused request's greedy picks are taken.
    Returns the rows and this engine's own cold {name: {"ids", "logits"}}, references for the other rows."""
    request = Turn("user", QUESTION, (photo(),))
    said = engine.processor.tokenizer.decode(first, skip_special_tokens=True)
    out, mine = [], {}
    for name in names:
        turns = {"follow-up": [request, Turn("assistant", said), Turn("user", FOLLOW_UP)],
                 "seen-image": [Turn("user", SEEN_IMAGE, (photo(),))], "regenerate": [request]}[name]
        reference = (references or {}).get(name)
        engine.forget()
        forced_chat(engine, [request], first, len(first))
        warm_logits, warm, ids = forced_chat(engine, turns, reference and reference["ids"], SCENARIO_TOKENS)
        engine.forget()
        cold_logits, cold, _ = forced_chat(engine, turns, ids, SCENARIO_TOKENS)
        mine[name] = {"ids": ids, "logits": cold_logits}
        row = {"name": name, "ttft_s": warm.ttft_s, "cold_ttft_s": cold.ttft_s, "reused_tokens": warm.reused_tokens,
               "cached_images": warm.cached_images, "cold_reused_tokens": cold.reused_tokens}
        if reference is not None:
            ref = reference["logits"]
            row["reuse_sqnr_db"] = fidelity(warm_logits, ref)["sqnr_db"]
            row["cold_sqnr_db"] = fidelity(cold_logits, ref)["sqnr_db"]
            picks = warm_logits.argmax(-1), cold_logits.argmax(-1)
            row["same_picks"] = (picks[0] == picks[1]).float().mean().item()
            if row["same_picks"] < 1:  # where the two ways first pick apart: how near a tie it is, against the noise
                i = int((picks[0] != picks[1]).nonzero()[0])
                row["split_at"], row["split_gap"] = i, (ref[i, picks[0][i]] - ref[i, picks[1][i]]).abs().item()
                row["split_noise"] = (cold_logits[i] - ref[i]).pow(2).mean().sqrt().item()
        out.append(row)
    return out, mine


def step_split(model, prompt_tokens: int, steps: int = 12) -> dict:
    """The lean decode step's median time after a text prompt of prompt_tokens, and its overhead: the same step with
    every linear of the text decoder and the head answering a ready-made output, so what is left is everything else
    (norms, rope, attention over the cache, residuals, dispatch), one op at a time (vnni's layers in one call are
    computed as their ops). Where qvl.engine.jit's kernels are on, also the step on torch's ops alone
    (step_torch_ms). The ways alternate, so noise hits them alike."""
    text = model.model.language_model
    linears = [m for layer in text.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    kernels = jit.ready.is_set()
    with torch.inference_mode():
        dtype = text.embed_tokens(torch.tensor([[0]])).dtype  # the linears' output: bf16 in a bf16 model
        outputs = [torch.randn(1, 1, m.out_features, dtype=dtype) * 0.1 for m in linears]
        prefill = generate._forward(model, input_ids=torch.randint(0, 256, (1, prompt_tokens)))
        decoders = {"full": lean.Decoder(model, prefill.cache, steps + 2, 0),  # a text prompt's delta is 0
                    "stubbed": lean.Decoder(model, prefill.cache, steps + 2, 0)}
        if kernels:
            decoders["torch"] = lean.Decoder(model, prefill.cache, steps + 2, 0)
        times = {way: [] for way in decoders}

        def step(way):
            fused = vnni.ready
            if way == "stubbed":
                for m, out in zip(linears, outputs):
                    m.forward = lambda x, out=out: out
                vnni.ready = False  # the layers in one call would read their weights, not the stubs
            if way == "torch":
                jit.ready.clear()
            try:
                start = time.perf_counter()
                decoders[way].step(7)
                return time.perf_counter() - start
            finally:
                vnni.ready = fused
                if way == "stubbed":
                    for m in linears:
                        del m.forward
                if way == "torch":
                    jit.ready.set()

        for way in decoders:  # an untimed first step each: first-call costs are not the step's
            if way != "stubbed":
                step(way)
        for _ in range(steps):
            for way in decoders:
                times[way].append(step(way))
    split = {"step_ms": statistics.median(times["full"]) * 1e3,
             "step_overhead_ms": statistics.median(times["stubbed"]) * 1e3}
    if kernels:
        split["step_torch_ms"] = statistics.median(times["torch"]) * 1e3
    return split


def kernels(out_features: int = 6144, in_features: int = 2048, ring_bytes: int = 640 << 20, repeats: int = 5,
            prompt_rows: int = 300) -> list[dict]:
    """Each kernel qvl can use without a compiler, through one linear (gate/up-sized by default): one decode row with
    the weights out of cache (a ring of copies of 640 MB, larger than the 480 MB L3 cache seen on an AMX Xeon), as time
    per call and weight bytes read per second, and a prompt's rows (the standard request's ~300) as GFLOP/s: what
    auto's choice for decode and prefill rests on. Where qvl.engine.vnni's kernel runs, also w8a14's decode row (in
    two parts) on oneDNN's weights, through oneDNN's own call and through vnni's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    row, prompt = torch.randn(1, in_features), torch.randn(prompt_rows, in_features)
    w = linear.weight.float()
    scale = w.abs().amax(1) / 127
    q = (w / scale[:, None]).round().to(torch.int8)
    int4 = quant.Int4Linear.quantize(linear, prefill=False)
    # Copies from what is quantized once: quantizing each copy again took most of the run.
    candidates = {  # name -> (make one copy of the weights, call it on x, weight bytes)
        "fbgemm int8": (lambda: _int8_linear(q, scale, "fbgemm"), lambda m, x: m(x), 1),
        "oneDNN int8": (lambda: _int8_linear(q, scale, "onednn"), lambda m, x: m(x), 1),
        "int4 g128, bf16 activations": (lambda: copy.deepcopy(int4), lambda m, x: m(x), 0.5),
        "int8 weight-only, bf16 activations": (lambda: (q.clone(), scale.bfloat16()),
                                               lambda m, x: torch._weight_int8pack_mm(x.bfloat16(), *m), 1),
        "int8 weight-only, fp32 activations": (lambda: (q.clone(), scale.clone()),
                                               lambda m, x: torch._weight_int8pack_mm(x, *m), 1),
        "bf16": (lambda: linear.weight.clone(), lambda m, x: x.bfloat16() @ m.t(), 2),
        "fp32": (lambda: w.clone(), lambda m, x: x @ m.t(), 4),
    }
    if modes.onednn_fits() and not cpu.arm() and jit.warm(settings.Settings().cache_dir) and vnni.warm():
        candidates["oneDNN int8, w8a14's row"] = (lambda: _int8_linear(q, scale, "onednn", two_part=True),
                                                  lambda m, x: _without_vnni(m, x), 1)
        candidates["vnni on oneDNN's int8, w8a14's row"] = (lambda: _int8_linear(q, scale, "onednn", two_part=True),
                                                             lambda m, x: m(x), 1)

    def median_seconds(call, ring: list, x: torch.Tensor) -> float:
        call(ring[0], x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for m in ring:
                call(m, x)
            times.append((time.perf_counter() - start) / len(ring))
        return statistics.median(times)

    rows = []
    with torch.inference_mode():
        for name, (make, call, bytes_per_weight) in candidates.items():
            ring = [make() for _ in range(-(-ring_bytes // int(out_features * in_features * bytes_per_weight)))]
            seconds = median_seconds(call, ring, row)
            prompt_seconds = median_seconds(call, ring[:1], prompt)  # compute-bound: the weights stay in cache
            rows.append({"kernel": name, "ms": seconds * 1e3,
                         "weights_gb_s": out_features * in_features * bytes_per_weight / seconds / 1e9,
                         "prompt_gflop_s": 2 * prompt_rows * out_features * in_features / prompt_seconds / 1e9})
            del ring
    return rows


def _int8_linear(values: torch.Tensor, scale: torch.Tensor, kernel: str, two_part: bool = False) -> quant.Int8Linear:
    """int8 values with a scale per row as an Int8Linear packed for kernel, settled into the pieces it serves in;
    two_part: w8a14's decode."""
    engine = torch.backends.quantized.engine
    quant.use_kernel(kernel)
    try:
        int8 = quant.Int8Linear(values, scale, None)
        while int8.settle():
            pass
        int8.two_part = two_part
        return int8
    finally:
        torch.backends.quantized.engine = engine


def _without_vnni(linear: quant.Int8Linear, x: torch.Tensor) -> torch.Tensor:
    vnni.ready = False
    try:
        return linear(x)
    finally:
        vnni.ready = True


def _fewer_bits(linear: torch.nn.Linear, bits: int, group: int) -> torch.nn.Module:
    """linear with its weights rounded to `bits`, symmetric, a bf16 scale for each `group` inputs of a row, and fp32
    activations: the best a kernel reading that many bits a weight (plus a scale a group) could compute."""
    weight = linear.weight.detach().float()
    groups = weight.view(weight.shape[0], -1, min(group, weight.shape[1]))
    top = 2 ** (bits - 1) - 1
    scale = (groups.abs().amax(-1, keepdim=True) / top).clamp_(min=torch.finfo(torch.bfloat16).tiny)
    scale = scale.bfloat16().float()
    rounded = ((groups / scale).round_().clamp_(-top - 1, top) * scale).view_as(weight)
    return _Call(lambda x: torch.nn.functional.linear(x, rounded, linear.bias))


def _late_mlps(bits: int, group: int):
    """The way of w8a14's decode, but the last half of the text layers' MLPs with weights of `bits` (_fewer_bits)."""
    def way(name, linear, loud, late):
        if late and ".mlp." in name:
            return _fewer_bits(linear, bits, group)
        return LINEAR_WAYS[W8A14_DECODE](name, linear, loud, late)
    return way


# How --linears computes every text linear and the head, each way against fp32: (name, linear, loud, late) -> a
# module, where loud is (channels, the checkpoint's columns for them) in linears that have loud channels, else None,
# and late says the linear is in the last half of the text layers. The int4 and int8 weight-only kernels take bf16
# activations (fast where the CPU has bf16 dot products). The two last ways ask what fewer bits per weight would keep
# where a model is least sensitive to them: they read int4 or int6 weights exactly, as no kernel would.
W8A14_DECODE = "the same, the first text layers' weights in two parts (`w8a14`'s decode)"
LINEAR_WAYS = {
    "int8, a scale per token, loud channels apart (`int8`)": lambda name, linear, loud, late:
        _apart(quant._dynamic_int8(linear), loud),
    "int8, activations in two parts, loud channels apart": lambda name, linear, loud, late:
        _decoding(_apart(quant._dynamic_int8(linear), loud)),
    W8A14_DECODE: lambda name, linear, loud, late:
        _decoding(_apart(checkpoint._w8a14(name, linear), loud)),
    "int8, a scale per token": lambda name, linear, loud, late: quant._dynamic_int8(linear),
    "int8, one scale per call": lambda name, linear, loud, late:  # qvl's first
        _Call(quant._dynamic_int8(linear)._matmul),
    "int8 weights, fp32 activations": lambda name, linear, loud, late: _Call(
        lambda x, weight=quant._dynamic_int8(linear).weight().dequantize(): torch.nn.functional.linear(x, weight)),
    "int8 weights, bf16 activations": lambda name, linear, loud, late: quant.Int8WeightOnly.quantize(linear),
    "int8 weights, bf16 activations, loud channels apart (`w8a16`)": lambda name, linear, loud, late:
        _apart(quant.Int8WeightOnly.quantize(linear), loud),
    f"int4 g{quant.GROUP} weights, bf16 activations": lambda name, linear, loud, late:
        quant.Int4Linear.quantize(linear, prefill=False),  # int4 for every row count, as it decodes
    "bf16": lambda name, linear, loud, late: _Call(
        lambda x, weight=linear.weight.bfloat16(): torch.nn.functional.linear(x.bfloat16(), weight).float()),
    "`w8a14`'s decode, the last half of the layers' MLP weights int6 g64": _late_mlps(6, 64),
    "`w8a14`'s decode, the last half of the layers' MLP weights int4 g32": _late_mlps(4, 32),
}


class _Call(torch.nn.Module):
    """A module whose forward is a function."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


def _apart(linear, loud):
    if loud is not None:
        linear.set_apart(*loud)
    return linear


def _decoding(linear: quant.Int8Linear) -> torch.nn.Module:
    """linear (an int8 one) computing each row in two parts, as w8a14 decodes: rows are quantized each on its own, so
    a prompt in decode-sized chunks is computed as decode steps compute it."""
    linear.two_part = True
    return _Call(lambda x: torch.cat([linear(rows) for rows in x.split(quant.DECODE_ROWS, -2)], -2))


def linears(folder: str, tokens: int = 300, kept: int = 128) -> list[dict]:
    """Fidelity of each of LINEAR_WAYS: teacher-forced logits of the last `kept` of `tokens` random byte tokens,
    text only, with every text linear and the head computed that way, against the fp32 model's. One way's modules at
    a time beside the fp32 model: the 2B's every way at once did not fit in 24 GB.

    int8 weights with fp32 activations bounds what any activation remedy (per-token or finer scales, outlier
    columns, rotations) can reach with these int8 weights; bf16 is what the issue's target is set against.
    """
    model = checkpoint.load_model(folder, "fp32")
    model.model.visual = None  # text only: 1.6 GB of the 2B's fp32 model
    floats = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))

    def logits():
        with torch.inference_mode():
            return model(input_ids=ids, logits_to_keep=kept).logits[0].float()

    layers = model.config.text_config.num_hidden_layers
    late = tuple(f"model.language_model.layers.{i}." for i in range(layers // 2, layers))

    def computing(way, loud):
        for name, linear in floats.items():
            checkpoint.swap(model, name, LINEAR_WAYS[way](name, linear, loud.get(name), name.startswith(late)))

    reference = logits()
    computing("int8, a scale per token", {})  # calibrated as a conversion calibrates: through the quantized linears
    channels = checkpoint.loud_channels(model, folder, {name: model.get_submodule(name) for name in floats})
    loud = {name: (channels[name], columns)
            for name, columns in checkpoint.checkpoint_columns(model, folder, channels).items()}
    rows = []
    for way in LINEAR_WAYS:
        computing(way, loud)
        rows.append({"way": way, **fidelity(logits(), reference)})
    return rows


def crowd(engine, count: int, stagger_s: float = 0.0) -> dict:
    """count standard requests arriving together (or stagger_s apart), each in a thread of its own as the server's
    workers run them: aggregate decode tok/s (every answer's tokens after its first, over the time from the first
    first token to the last end, the others' prefills included), the time until the last answer ends, p50/p95 time
    to first token, the longest pause between two pieces of one running stream, and full_batch_tok_s: the decode rate
    of the steps that took all count answers, the others' prefills left out."""
    params = settings.GenParams(greedy=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, max_image_tokens=320)
    turn, results = Turn("user", QUESTION, (photo(),)), [None] * count
    scheduler = engine.scheduler
    steps, seconds = (dict(scheduler.sizes), dict(scheduler.seconds)) if scheduler else ({}, {})
    begin = time.perf_counter()

    def ask(i):
        time.sleep(max(0.0, begin + i * stagger_s - time.perf_counter()))
        arrived, times, stats = time.perf_counter(), [], None
        for piece in engine.chat([turn], params):
            if isinstance(piece, str):
                times.append(time.perf_counter())
            else:
                stats = piece
        results[i] = arrived, times, stats

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ttfts = sorted(times[0] - arrived for arrived, times, _ in results)
    decoding = max(times[-1] for _, times, _ in results) - min(times[0] for _, times, _ in results)
    return {"count": count, "stagger_s": stagger_s, "batch": engine.settings.batch,
            "aggregate_tok_s": sum(stats.new_tokens - 1 for _, _, stats in results) / decoding,
            "last_end_s": max(times[-1] for _, times, _ in results) - begin,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": ttfts[min(count - 1, round(0.95 * (count - 1)))],
            "longest_pause_s": max(b - a for _, times, _ in results for a, b in zip(times, times[1:])),
            "answer_tok_s": statistics.median(stats.decode_tok_s for _, _, stats in results),
            "largest_batch": max(stats.batch for _, _, stats in results),
            # The decode rate of the steps that took all `count` answers, from the scheduler's own timing.
            "full_batch_tok_s": count * (scheduler.sizes[count] - steps.get(count, 0))
            / (scheduler.seconds[count] - seconds.get(count, 0)) if scheduler and scheduler.sizes[count] > steps.get(
                count, 0) else None}


def crowds(make_engine, levels: list[int], seats: int) -> list[dict]:
    """crowd() at each level, together and one a second, with --batch seats; then with --batch 1 the levels up to 4
    arriving together. make_engine(batch) gives a warm engine."""
    rows = []
    for batch in (seats, 1) if seats > 1 else (1,):
        engine = make_engine(batch)
        for count in levels:
            for stagger in (0.0, 1.0) if batch == seats else (0.0,):
                if batch == seats or count <= 4:
                    rows.append(crowd(engine, count, stagger))
                    print(f"crowd: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        engine.close()
    return rows


def crowd_child(args, ahead: modelcache.Reader | None):
    """The --concurrent measurement of one row, in its process: the engine of each batch size reads the model the
    first one converted, from the row's model cache."""
    features = tempfile.mkdtemp()
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(settings.Settings().cache_dir, "numba"))

    def make_engine(batch: int):
        nonlocal ahead
        argv = ["--model", args.model, "--quant", args.quant, "--no-cache", "--require-model", "--cache-dir", features,
                "--model-cache-dir", args.model_cache_dir, "--kv-memory", "0", "--feature-cache-size", "0",
                "--batch", str(batch)]
        engine = Engine(settings.parse(argv, env=row_variables()),
                        ahead)
        ahead = None  # read by the first engine
        sys.setswitchinterval(cpu.SERVING_SWITCH_S)
        engine.settled.wait()
        crowd(engine, 1)  # first-call costs are not the crowd's
        return engine

    rows = crowds(make_engine, [int(level) for level in args.concurrent.split(",")], args.batch)
    Path(args.out).write_text(json.dumps({"name": args.child, "crowds": rows}))
    shutil.rmtree(features, ignore_errors=True)


CROWD_COLUMNS = ["batch", "count", "stagger_s", "aggregate_tok_s", "last_end_s", "ttft_p50_s", "ttft_p95_s",
                 "longest_pause_s", "answer_tok_s", "largest_batch", "full_batch_tok_s"]


def crowd_table(rows: list[dict]) -> str:
    lines = ["| row | " + " | ".join(CROWD_COLUMNS) + " |", "|---|" + "---|" * len(CROWD_COLUMNS)]
    return "\n".join(lines + [f"| {row['name']} | " + " | ".join("-" if crowd[k] is None else f"{crowd[k]:.3g}"
                                                                for k in CROWD_COLUMNS) + " |"
                              for row in rows for crowd in row["crowds"]])


def process_age() -> float:
    """Seconds since this process started, its imports included (Linux: the start time in /proc/self/stat)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


# The QVL_* variables a row's engine takes from its environment (ROWS' variants); the rest are the bench's own.
ROW_VARIABLES = tuple(sorted({name for _, env, _ in ROWS.values() for name in env if name.startswith("QVL_")}))


def row_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in ROW_VARIABLES}


def child(args, ahead: modelcache.Reader | None):
    """One row: load through the Engine, warm up, time --runs answers, then measure fidelity against fp32's."""
    start = time.perf_counter()
    features = tempfile.mkdtemp()  # the image-feature store starts empty, and the user's is left alone
    argv = ["--model", args.model, "--quant", args.quant, "--no-cache", "--require-model", "--cache-dir", features,
            "--model-cache-dir", args.model_cache_dir]
    # The decode kernels compile once into the app's numba cache, not in every row's background.
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(settings.Settings().cache_dir, "numba"))
    engine = Engine(settings.parse(argv, env=row_variables()),
                    ahead)
    ready_s = process_age()  # the model is in: a request could be answered, paying the first call's costs
    sys.setswitchinterval(cpu.SERVING_SWITCH_S)
    engine.settled.wait()  # a start from the model cache repacks its pieces in the background: time the result
    settled_s = process_age()
    if args.child.endswith("+compile"):  # the language model only: the vision tower runs once per image
        engine.model.model.language_model.compile(dynamic=True)
    params = settings.GenParams(greedy=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, max_image_tokens=320)
    turn = Turn("user", QUESTION, (photo(),))
    runs = []
    for i in range(args.runs + 1):
        engine.forget()
        runs.append(list(engine.chat([turn], params))[-1])
        if i == 0:
            load_s = time.perf_counter() - start  # ready means warmed up: first-call costs belong to loading
    runs = runs[1:]
    inputs, image_tokens = engine._inputs([turn], params)
    reference = Path(args.reference)
    ref = torch.load(reference) if reference.exists() and args.child != "fp32" else None
    ids = ref["ids"] if ref else list(generate.stream(engine.model, inputs, params, threading.Event()))
    memory, own = scenarios(engine, args.scenarios.split(","), ids, ref and ref["scenarios"]) if args.scenarios \
        else (None, {})
    # What serving costs: taken before the fidelity pass, whose full-vocabulary logits are the bench's own load.
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    # Each row's bound its own: a shared machine's read bandwidth swings between minutes (17 to 27 GB/s on one), and
    # one figure taken before all rows put a row's decode at 118% of it. After the peak: the probe's 1 GiB is not
    # the row's memory.
    bandwidth = bandwidth_gb_s()
    split = step_split(engine.model, runs[0].prompt_tokens)
    if args.child == "fp32":
        torch.save({"ids": ids, "logits": teacher_forced_logits(engine.model, inputs, ids), "scenarios": own},
                   reference)
        ref = torch.load(reference)
    row = {
        "name": args.child, "precision": engine.precision, "threads": engine.threads, "jit": jit.ready.is_set(),
        "ready_s": ready_s, "settled_s": settled_s, "load_s": load_s, "read_ahead": ahead is not None,
        "ttft_s": statistics.median(s.ttft_s for s in runs),
        "decode_tok_s": statistics.median(s.decode_tok_s for s in runs),
        "e2e_s": statistics.median(s.total_s for s in runs),
        "image_tokens": image_tokens, "prompt_tokens": runs[0].prompt_tokens, "new_tokens": runs[0].new_tokens,
        **split, "decode_gb": decode_bytes(engine.model) / 1e9, "bandwidth_gb_s": bandwidth,
        "kv_memory_gb": engine.kv.limit / 1e9 if engine.kv else 0,
    }
    if memory:
        row["scenarios"] = memory
    if ref:
        row.update(fidelity(teacher_forced_logits(engine.model, inputs, ref["ids"]), ref["logits"]))
    row["peak_rss_gb"] = peak_rss_gb
    Path(args.out).write_text(json.dumps(row))
    shutil.rmtree(features, ignore_errors=True)


# A row's process starts the way app.py does: the stored model read ahead while transformers imports, and no garbage
# collected until the imports are done.
CHILD = """
import os, sys
from qvl import settings
from qvl.engine import cpu, heap, modelcache
heap.limit_arenas()  # before any thread
heap.map_apart()  # before the model loads
cpu.hold_collector()  # until the imports are done
sys.setswitchinterval(cpu.LOADING_SWITCH_S)  # until the engine is ready
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
ahead = modelcache.read_ahead(settings.parse([f for k in ("--model", "--quant", "--model-cache-dir")
                                              for f in (k, flags[k])],
                                             env={k: v for k, v in os.environ.items() if k in %r}))
from qvl.tools import bench
cpu.release_collector()
bench.main(sys.argv[1:], ahead)
""" % (ROW_VARIABLES,)


def run_row(name: str, model: str, runs: int, reference: Path, memory: str, concurrent: str = "",
            batch: int = 1) -> dict:
    mode, env, prefix = ROWS[name]
    # Each row starts cold, with a model cache of its own, except that NAME-warm shares NAME's.
    models = reference.parent / "models" / name.removesuffix("-warm")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [*prefix, sys.executable, "-c", CHILD, "--child", name, "--quant", mode, "--model", model,
                   "--runs", str(runs), "--reference", str(reference), "--out", out.name, "--scenarios", memory,
                   "--model-cache-dir", str(models), "--concurrent", concurrent, "--batch", str(batch)]
        subprocess.run(command, check=True, env={**os.environ, **env})
        return json.loads(Path(out.name).read_text())


COLUMNS = ["name", "ready_s", "settled_s", "load_s", "ttft_s", "decode_tok_s", "e2e_s", "peak_rss_gb", "bound_tok_s",
           "of_bound", "step_ms", "step_torch_ms", "step_overhead_ms", "sqnr_db", "kl", "top1_agreement"]


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["name"] == "fp32"), None)

    def cell(row, key):
        value = row.get(key)
        if value is None:
            return "-"
        if isinstance(value, str):
            return value
        text = f"{value:.3g}" if key != "of_bound" else f"{value:.0%}"
        if base and key in ("load_s", "ttft_s", "decode_tok_s", "e2e_s", "peak_rss_gb") and row is not base:
            text += f" ({value / base[key]:.2f}x)"
        return text

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, k) for k in COLUMNS) + " |" for r in rows]
    memory = [(r["name"], s) for r in rows for s in r.get("scenarios", [])]
    if memory:
        lines += ["", "| row | scenario | ttft_s | cold_ttft_s | ratio | reused_tokens | cached_images | reuse_sqnr_db "
                  "| cold_sqnr_db | same_picks |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {row} | {s['name']} | {s['ttft_s']:.3g} | {s['cold_ttft_s']:.3g} | "
                  f"{s['ttft_s'] / s['cold_ttft_s']:.3f}x | {s['reused_tokens']} | {s['cached_images']} | "
                  + " | ".join(f"{s[k]:.3g}" if k in s else "-" for k in ("reuse_sqnr_db", "cold_sqnr_db", "same_picks"))
                  + " |"
                  for row, s in memory]
    return "\n".join(lines)


def main(argv=None, ahead: modelcache.Reader | None = None):
    """The command line; ahead: a row's process's read-ahead (CHILD)."""
    parser = argparse.ArgumentParser(prog="python -m qvl.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or hub id (real weights)")
    parser.add_argument("--random-weights", action="store_true", help="the 2B architecture with random weights")
    parser.add_argument("--outliers", action="store_true", help="with --random-weights: random weights with real "
                        "checkpoints' activation outliers planted (a few channels 32-64x the rest in every text "
                        f"linear's input; see plant_outliers), built once in {OUTLIER_DIR}")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per row, after one warm-up")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--scenarios", default="", help=f"comma-separated subset of {', '.join(SCENARIOS)}: "
                        "conversation memory, each request against itself cold")
    parser.add_argument("--kernels", action="store_true",
                        help="instead of the rows: one decode row and a prompt through one 6144x2048 linear in each kernel")
    parser.add_argument("--linears", action="store_true",
                        help="instead of the rows: the fidelity of each way to compute the text linears "
                        f"({'; '.join(LINEAR_WAYS)}), in one process, text only")
    parser.add_argument("--concurrent", default="", help="instead of the rows' figures: comma-separated crowd sizes "
                        "(1,4,8), each that many standard requests at once and one a second, decoded together")
    parser.add_argument("--batch", type=int, help="with --concurrent: the seats of the engine the crowds meet "
                        "(default: the largest crowd, at most 8), against --batch 1")
    for hidden in ("--child", "--quant", "--reference", "--out", "--model-cache-dir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return (crowd_child if args.concurrent else child)(args, ahead)
    if args.concurrent and not all(level.isdigit() and int(level) > 0 for level in args.concurrent.split(",")):
        parser.error(f"--concurrent takes crowd sizes such as 1,4,8, not {args.concurrent}")
    low, high = settings.BOUNDS["batch"]
    if args.batch is not None and not (args.concurrent and low <= args.batch <= high):
        parser.error(f"--batch takes {low} to {high} seats, with --concurrent")
    if args.concurrent:
        args.batch = args.batch or min(high, max(int(level) for level in args.concurrent.split(",")))
    if args.kernels:
        print(f"{cpu.describe()}; torch {torch.__version__}; 6144x2048 weights: one decode row out of cache, "
              "a 300-row prompt\n")
        print("| kernel | decode ms | weights GB/s | prompt GFLOP/s |\n|---|---|---|---|")
        for row in kernels():
            print(f"| {row['kernel']} | {row['ms']:.3g} | {row['weights_gb_s']:.3g} | {row['prompt_gflop_s']:.3g} |")
        return
    if not args.model and not args.random_weights:
        parser.error("give --model or --random-weights")
    if args.outliers and not args.random_weights:
        parser.error("--outliers plants outliers in the random weights: give --random-weights, not --model")
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if unknown := [n for n in args.scenarios.split(",") if n and n not in SCENARIOS]:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.model:
        model, weights, described = args.model, "given", args.model
    elif args.outliers:
        model, weights = str(built_apart(outlier_checkpoint, OUTLIER_DIR)), "outliers"
        described = "random-weights Qwen3-VL-2B with planted activation outliers"
    else:
        model, weights = str(built_apart(random_checkpoint, RANDOM_DIR)), "plain"
        described = "random-weights Qwen3-VL-2B"
    if args.linears:
        rows = linears(model)
        print(f"{cpu.describe()}; torch {torch.__version__}; {described}; text logits teacher-forced against fp32\n")
        print("| way | sqnr_db | kl | top1_agreement |\n|---|---|---|---|")
        for row in rows:
            print(f"| {row['way']} | {row['sqnr_db']:.3g} | {row['kl']:.3g} | {row['top1_agreement']:.3g} |")
        if args.json:
            machine = {"cpu": cpu.describe(), "torch": torch.__version__, "model": described}
            Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        return
    machine = {"cpu": cpu.describe(), "torch": torch.__version__, "model": described, "weights": weights,
               "runs": args.runs}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                row = run_row(name, model, args.runs, Path(tmp) / "fp32-reference.pt", args.scenarios,
                              args.concurrent, args.batch or 1)
            except subprocess.CalledProcessError as e:  # one failed configuration must not lose the others
                print(f"{name}: failed with exit code {e.returncode}", file=sys.stderr, flush=True)
                continue
            if args.concurrent:
                rows.append(row)
                continue
            row["bound_tok_s"] = row["bandwidth_gb_s"] / row["decode_gb"]
            row["of_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    if args.concurrent:
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        print(f"{machine['cpu']}; torch {machine['torch']}; {machine['model']}; {NEW_TOKENS} tokens an answer\n")
        print(crowd_table(rows))
        return
    read = sorted(row["bandwidth_gb_s"] for row in rows) or [0]
    print(f"{machine['cpu']}; torch {machine['torch']}; {read[0]:.1f}-{read[-1]:.1f} GB/s read (each row's bound from "
          f"its own); {machine['model']}; median of {args.runs} runs after 1 warm-up\n")
    print(table(rows))


if __name__ == "__main__":
    main()
