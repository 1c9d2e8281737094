import functools
import json
import math
import subprocess
import sys
import threading

import pytest
import torch

from qvl import settings
from qvl.engine import checkpoint, cpu, jit, modes, quant, vnni
from qvl.tools import bench


def test_sqnr_is_infinite_for_identical_logits_and_low_for_noise():
    torch.manual_seed(0)
    ref = torch.randn(8, 50)
    same = bench.fidelity(ref.clone(), ref)
    assert math.isinf(same["sqnr_db"]) and abs(same["kl"]) < 1e-6 and same["top1_agreement"] == 1.0
    close = bench.fidelity(ref + 0.01 * torch.randn(8, 50), ref)
    noise = bench.fidelity(torch.randn(8, 50), ref)
    assert 35 < close["sqnr_db"] < 45
    assert noise["sqnr_db"] < 1 and noise["kl"] > close["kl"] and noise["top1_agreement"] < 0.5


def test_decode_bytes_shrink_with_quantization(tiny_dir):
    fp32 = bench.decode_bytes(checkpoint.load_model(str(tiny_dir), "fp32"))
    int4 = bench.decode_bytes(checkpoint.load_model(str(tiny_dir), "int4"))
    assert 0.1 * fp32 < int4 < 0.3 * fp32


# oneDNN's int8 kernel where this CPU runs it (modes.onednn_fits).
ONEDNN_ROW = ["auto+onednn"] if modes.onednn_fits() and not cpu.arm() else []


def test_bench_smoke_on_the_tiny_model_writes_the_json_schema(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "qvl.bench", "--model", str(tiny_dir), "--rows", "fp32,auto,auto-warm,auto+nojit,"
         "auto+fbgemm" + "".join("," + row for row in ONEDNN_ROW), "--runs", "1", "--json", str(out), "--scenarios",
         "regenerate"], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    # Each row's bound comes from the bandwidth read in its own process.
    assert all(r["bandwidth_gb_s"] > 0 and r["bound_tok_s"] == r["bandwidth_gb_s"] / r["decode_gb"] for r in data["rows"])
    assert [r["name"] for r in data["rows"]] == ["fp32", "auto", "auto-warm", "auto+nojit", "auto+fbgemm",
                                                 *ONEDNN_ROW]
    assert [r["jit"] for r in data["rows"]] == [True, True, True, False, True, *[True] * len(ONEDNN_ROW)]  # QVL_JIT=0
    # and QVL_INT8_KERNEL reaches the row, as every row's variables do (the test below)
    assert "oneDNN" not in data["rows"][4]["precision"] and "KV cache bf16" in data["rows"][1]["precision"]
    assert all("oneDNN int8" in r["precision"] for r in data["rows"][5:])
    # Where the kernels ran, the step is timed on torch's ops alone beside them.
    assert ["step_torch_ms" in r for r in data["rows"]][:4] == [True, True, True, False]
    for row in data["rows"]:
        assert {"ready_s", "settled_s", "load_s", "ttft_s", "decode_tok_s", "e2e_s", "peak_rss_gb", "sqnr_db", "kl",
                "top1_agreement", "step_ms", "step_overhead_ms"} <= set(row)
        assert row["new_tokens"] == bench.NEW_TOKENS and row["image_tokens"] == 300
        assert [s["name"] for s in row["scenarios"]] == ["regenerate"]
    assert math.isinf(data["rows"][0]["sqnr_db"]) and data["rows"][1]["sqnr_db"] < 60
    assert data["rows"][2]["sqnr_db"] == data["rows"][1]["sqnr_db"]  # the second start holds the same model
    # Only the second start has a stored model to read while it imports, as the app's second start does.
    assert [r["read_ahead"] for r in data["rows"]][:4] == [False, False, True, False]
    assert "| fp32 |" in result.stdout and "| auto |" in result.stdout and "| auto | regenerate |" in result.stdout


def test_every_rows_qvl_variables_change_the_setting_they_name():
    # A row's child process gets its variables as the smoke above shows; a misspelt name would change nothing.
    default = settings.parse([], env={})
    for name, (_, env, _) in bench.ROWS.items():
        for variable, value in env.items():
            if variable.startswith("QVL_"):
                field = variable.removeprefix("QVL_").lower()
                assert getattr(settings.parse([], env={variable: value}), field) != getattr(default, field), name


def test_memory_scenarios_reuse_and_time_the_same_request_cold(engine):
    request = bench.Turn("user", bench.QUESTION, (bench.photo(),))
    first = bench.forced_chat(engine, [request], None, 8)[2]
    results, references = bench.scenarios(engine, bench.SCENARIOS, first)
    assert [r["name"] for r in results] == list(bench.SCENARIOS) == list(references)
    for r in results:
        assert r["ttft_s"] > 0 and r["cold_ttft_s"] > 0 and r["reused_tokens"] > 0 and r["cold_reused_tokens"] == 0
        assert "reuse_sqnr_db" not in r  # nothing to compare with: these are the references
    params = settings.GenParams(max_image_tokens=320)
    prompt = engine._inputs([request], params)[0]["input_ids"].shape[1]
    assert results[-1]["reused_tokens"] == prompt - 1  # Regenerate: all but the last prompt token
    # Given references, each scenario answers their tokens, and fp32 against itself, reuse included, is exact.
    again, _ = bench.scenarios(engine, bench.SCENARIOS, first, references)
    for r in again:
        assert r["cold_sqnr_db"] == math.inf and r["reuse_sqnr_db"] > 60


def test_forced_chat_answers_the_given_tokens_and_records_what_it_would_have_picked(engine):
    turns = [bench.Turn("user", "Hello!")]
    logits, stats, greedy = bench.forced_chat(engine, turns, None, 6)
    forced = [greedy[0], *(t + 1 for t in greedy[1:])]  # from the second token on, not what it would pick
    again, stats, ids = bench.forced_chat(engine, turns, forced, 6)
    assert ids == forced and stats.new_tokens == 6 and logits.shape == again.shape == (6, logits.shape[1])
    assert torch.allclose(again[:2], logits[:2], atol=1e-5)  # the same prefix, the same logits
    assert not torch.allclose(again[2:], logits[2:], atol=1e-3)  # fed other tokens, it predicts otherwise


def test_step_overhead_is_the_step_without_its_matmuls_and_leaves_the_model_as_it_was(engine, kernels, monkeypatch):
    choice, kernel_calls = kernels
    turn = bench.Turn("user", bench.QUESTION, (bench.photo(),))
    params = settings.GenParams(greedy=True, max_new_tokens=8, min_new_tokens=8)
    before = list(engine.chat([turn], params))[:-1]
    calls = []
    linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(1) or linear(self, x))
    kernel_calls.clear()
    split = bench.step_split(engine.model, 20, steps=3)
    layers = len(engine.model.model.language_model.layers)
    # The prefill, then for each full way (the kernels', and torch's ops alone where the kernels are on) a first
    # (untimed) step and the 3 timed ones, call every text linear and the head once; the 3 stubbed steps call none.
    ways = 2 if choice == "jit" else 1
    assert len(calls) == (1 + ways * (1 + 3)) * (4 * layers + 1)
    assert split["step_ms"] > 0 and split["step_overhead_ms"] > 0
    if choice == "jit":  # the kernels ran in the full and the stubbed steps, never in torch's
        assert kernel_calls.count("attend") == (1 + 3 + 3) * layers and split["step_torch_ms"] > 0
        assert jit.ready.is_set()
    else:
        assert kernel_calls == [] and "step_torch_ms" not in split
    assert not any("forward" in vars(m) for m in engine.model.modules())
    engine.forget()
    assert list(engine.chat([turn], params))[:-1] == before


def test_step_overhead_is_measured_in_a_bf16_model_too(tiny_dir):
    model = checkpoint.load_model(str(tiny_dir), "bf16")
    split = bench.step_split(model, 20, steps=2)  # the stubs answer in the model's own dtype
    assert split["step_ms"] > 0 and split["step_overhead_ms"] > 0


def _standard_inputs(tiny_dir):
    from qvl.engine.local import Engine
    engine = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--kv-memory", "0",
                                    "--feature-cache-size", "0"], env={}))
    params = settings.GenParams(greedy=True, max_new_tokens=6, min_new_tokens=6, max_image_tokens=320)
    return engine._inputs([bench.Turn("user", bench.QUESTION, (bench.photo(),))], params)[0]


def test_fidelity_logits_are_the_answer_s_own_in_fp32(tiny_dir):
    from qvl.engine import generate
    model = checkpoint.load_model(str(tiny_dir), "fp32")
    inputs = _standard_inputs(tiny_dir)
    params = settings.GenParams(greedy=True, max_new_tokens=6, min_new_tokens=6)
    answer = list(generate.stream(model, dict(inputs), params, threading.Event()))
    logits = bench.teacher_forced_logits(model, dict(inputs), answer)
    assert logits.shape[0] == len(answer) and logits.argmax(-1).tolist() == answer  # greedy picked these
    # One forward over prompt and answer (transformers' path) gives the same logits within float error.
    forced = dict(inputs, input_ids=torch.cat([inputs["input_ids"], torch.tensor([answer[:-1]])], 1))
    forced["attention_mask"] = torch.ones_like(forced["input_ids"])
    forced["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(answer) - 1,
                                             dtype=inputs["mm_token_type_ids"].dtype)], 1)
    with torch.inference_mode():
        whole = model(**forced, logits_to_keep=len(answer)).logits[0]
    torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)


def test_fidelity_of_int4_goes_through_its_decode_kernel(tiny_dir, monkeypatch):
    model = checkpoint.load_model(str(tiny_dir), "int4")
    rows = []
    forward = quant.Int4Linear.forward
    monkeypatch.setattr(quant.Int4Linear, "forward", lambda self, x: rows.append(x.numel() // self.in_features)
                        or forward(self, x))
    bench.teacher_forced_logits(model, _standard_inputs(tiny_dir), [5, 6, 7, 8])
    linears = sum(isinstance(m, quant.Int4Linear) for m in model.modules())
    assert rows.count(1) >= 3 * linears  # three decode steps, each through every int4 linear with one row


def test_kernels_time_each_way_to_read_a_linear():
    engine = torch.backends.quantized.engine
    rows = bench.kernels(out_features=64, in_features=128, ring_bytes=2 * 64 * 128 * 4, repeats=1, prompt_rows=8)
    # w8a14's row on oneDNN's weights, its own call against vnni's kernel, where that kernel runs (AVX-512 VNNI)
    ours = ["oneDNN int8, w8a14's row", "vnni on oneDNN's int8, w8a14's row"] if vnni.ready else []
    assert [r["kernel"] for r in rows] == ["fbgemm int8", "oneDNN int8",
                                           "int4 g128, bf16 activations", "int8 weight-only, bf16 activations",
                                           "int8 weight-only, fp32 activations", "bf16", "fp32", *ours]
    assert vnni.ready or "AMX" not in cpu.flags()  # an AMX Xeon's oneDNN packs its weights as vnni reads them
    assert all(r["ms"] > 0 and r["weights_gb_s"] > 0 and r["prompt_gflop_s"] > 0 for r in rows)
    assert torch.backends.quantized.engine == engine  # oneDNN's packing leaves fbgemm the engine of everything else


@pytest.mark.parametrize("kernel", ["fbgemm", "onednn"])
def test_each_int8_way_computes_the_same_linear_in_its_kernels_layout(kernel):
    if kernel == "onednn" and (cpu.arm() or not modes.onednn_fits()):
        pytest.skip("oneDNN's int8 kernel needs AVX-512 VNNI or AMX")
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    int8 = bench._int8_linear(*quant._int8_rows(linear.weight.detach()), kernel)
    assert int8.onednn == (kernel == "onednn") and len(int8.parts) == 1
    for rows in (1, 300):
        x = torch.randn(rows, 128)
        error = (int8(x) - linear(x)).norm() / linear(x).norm()
        assert error < 0.02, error


def test_the_kernels_flag_prints_its_table(monkeypatch, capsys):
    # The flag's own path with small weights: its 640 MB ring took half a minute, and kernels() is tested above.
    monkeypatch.setattr(bench, "kernels", functools.partial(bench.kernels, out_features=64, in_features=128,
                                                            ring_bytes=2 * 64 * 128 * 4, repeats=1, prompt_rows=8))
    bench.main(["--kernels"])
    out = capsys.readouterr().out
    assert "| fbgemm int8 |" in out and "| fp32 |" in out and "torch 2" in out
    assert "| kernel | decode ms | weights GB/s | prompt GFLOP/s |" in out


def test_linears_measures_each_way_to_compute_the_linears_against_fp32(tiny_dir):
    rows = {r["way"]: r for r in bench.linears(str(tiny_dir), tokens=24, kept=8)}
    assert list(rows) == list(bench.LINEAR_WAYS)
    assert all(0 < r["sqnr_db"] < 200 for r in rows.values())  # every way differs from fp32, none wildly
    # bf16 above int8 weights read exactly, above qvl's int8, above int8 with one activation scale for the prompt
    order = ["bf16", "int8 weights, fp32 activations", "int8, a scale per token", "int8, one scale per call"]
    assert [way for way in sorted(rows, key=lambda way: -rows[way]["sqnr_db"]) if way in order] == order
    # Weight-only kernels: int4 reads its weights less exactly than int8 does, bf16 activations cost int8 little
    int4, int8_bf16 = rows[f"int4 g{quant.GROUP} weights, bf16 activations"], rows["int8 weights, bf16 activations"]
    assert int4["sqnr_db"] < int8_bf16["sqnr_db"] < rows["bf16"]["sqnr_db"]
    assert int8_bf16["sqnr_db"] > rows["int8 weights, fp32 activations"]["sqnr_db"] - 6
    # Two parts read the activations to 14 bits: the int8 weights' own level, far above a single part's
    two_parts = rows["int8, activations in two parts, loud channels apart"]["sqnr_db"]
    assert abs(two_parts - rows["int8 weights, fp32 activations"]["sqnr_db"]) < 0.5
    assert two_parts > rows["int8, a scale per token"]["sqnr_db"] + 3
    # ...which the first layers' weights in two parts pass (all the tiny model's layers; its head stays one part)
    w8a14 = rows[bench.W8A14_DECODE]["sqnr_db"]
    assert w8a14 > two_parts + 2
    # Fewer bits in the last half of the layers' MLPs, read exactly, lose what w8a14 gained: int4 more than int6
    int6, int4 = (rows[f"`w8a14`'s decode, the last half of the layers' MLP weights {w}"]["sqnr_db"]
                  for w in ("int6 g64", "int4 g32"))
    assert int4 + 3 < int6 < w8a14 - 1


def test_linears_shows_what_setting_loud_channels_apart_gains_where_activations_carry_outliers(tiny_dir, loud_dir):
    pairs = [("int8, a scale per token, loud channels apart (`int8`)", "int8, a scale per token", 10),
             ("int8 weights, bf16 activations, loud channels apart (`w8a16`)", "int8 weights, bf16 activations", 3)]
    plain = {r["way"]: r["sqnr_db"] for r in bench.linears(str(tiny_dir), tokens=24, kept=8)}
    loud = {r["way"]: r["sqnr_db"] for r in bench.linears(str(loud_dir[0]), tokens=96, kept=32)}
    for apart, together, gain in pairs:
        assert plain[apart] == plain[together]  # no loud channel: nothing set apart
        assert loud[apart] > loud[together] + gain
    two_parts = loud["int8, activations in two parts, loud channels apart"]
    assert two_parts > loud["int8, a scale per token, loud channels apart (`int8`)"] + 3
    assert loud["the same, the first text layers' weights in two parts (`w8a14`'s decode)"] > two_parts + 2


def test_the_linears_flag_prints_its_table(tiny_dir):
    result = subprocess.run([sys.executable, "-m", "qvl.bench", "--model", str(tiny_dir), "--linears"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| int8 weights, fp32 activations |" in result.stdout and "| bf16 |" in result.stdout
    assert "--linears" in subprocess.run([sys.executable, "-m", "qvl.bench", "--help"], capture_output=True,
                                         text=True, timeout=120).stdout


def _inputs_and_logits(model, ids):
    """Every text linear's input (tokens x channels) and the logits, for ids."""
    seen, hooks = {}, []

    def keep(name):
        return lambda module, args, out: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))
    for name, module in model.model.language_model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(keep(name)))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0]
    for h in hooks:
        h.remove()
    return seen, logits


def test_planted_outliers_reach_their_ratio_in_every_linear_input_and_leave_logits_sane(small_model):
    plain, model = small_model(), small_model()
    planted = bench.plant_outliers(model)
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(5))  # not the planting's tokens
    inputs, logits = _inputs_and_logits(model, ids)
    low, high = bench.OUTLIER_FACTORS
    for i in range(2):
        # A value channel (head, dim) reaches o_proj through both query heads that read value head `head`.
        columns = [(c // 64 * 2 + g) * 64 + c % 64 for c in planted["values"][i] for g in range(2)]
        spots = {"self_attn.q_proj": planted["residual"], "self_attn.v_proj": planted["residual"],
                 "mlp.up_proj": planted["residual"], "mlp.down_proj": planted["mlp"][i], "self_attn.o_proj": columns}
        for name, channels in spots.items():
            x = inputs[f"layers.{i}.{name}"]
            rms = x.pow(2).mean(0).sqrt()
            ratio = rms / rms.median()
            rest = torch.ones_like(ratio, dtype=torch.bool)
            rest[channels] = False
            assert (ratio[channels] > 0.6 * low).all() and (ratio[channels] < 1.6 * high).all(), (i, name)
            assert ratio[rest].max() < 0.5 * low, (i, name)  # the outliers are the planted ones
            assert x.abs().amax() > 4 * x[:, rest].abs().amax()  # a per-tensor scale is that much coarser for the rest
    _, reference = _inputs_and_logits(plain, ids)
    assert logits.isfinite().all()
    assert 0.5 < logits.std() / reference.std() < 2  # the planted model's logits spread as the plain one's do
    assert bench.fidelity(logits, reference)["sqnr_db"] > 10  # and are close to them: RMSNorm's scale grew ~4%
    assert logits.argmax(-1).unique().numel() > 48  # and still depend on the position's tokens


def test_folding_norm_weights_leaves_the_outliers_that_live_in_the_hidden_state(small_model):
    model = small_model()
    planted = bench.plant_outliers(model)
    inputs, _ = _inputs_and_logits(model, torch.arange(64)[None])
    for norm, linear in (("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.up_proj")):
        gamma = model.model.language_model.layers[1].get_submodule(norm).weight.detach()
        folded = inputs[f"layers.1.{linear}"] / gamma  # what the linear reads once gamma is folded into it
        rms = folded.pow(2).mean(0).sqrt()
        stream = torch.tensor(planted["in_stream"])  # the part of each factor in the residual stream
        assert (rms[planted["residual"]] / rms.median() > 0.6 * stream).all() and stream.min() > 5


def _noise_sqnr(model, ids):
    """Logits SQNR after noise of 1% of each output channel's RMS on every text linear: how much errors grow."""
    generator = torch.Generator().manual_seed(3)

    def noise(module, args, out):
        return out + 0.01 * out.reshape(-1, out.shape[-1]).pow(2).mean(0).sqrt() * torch.randn(out.shape,
                                                                                               generator=generator)
    with torch.inference_mode():
        clean = model(input_ids=ids).logits[0]
        hooks = [m.register_forward_hook(noise) for m in model.model.language_model.modules()
                 if isinstance(m, torch.nn.Linear)]
        noisy = model(input_ids=ids).logits[0]
    for h in hooks:
        h.remove()
    return bench.fidelity(noisy, clean)["sqnr_db"]


def test_planted_model_amplifies_errors_no_more_than_the_plain_one(small_model):
    # Were the outliers all in the residual stream, they would dominate each token's RMS and every error in them
    # would rescale the whole token: quantization would then look worse for a reason other than outliers.
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(5))
    plain, model, all_in_stream = small_model(), small_model(), small_model()
    bench.plant_outliers(model)
    bench.plant_outliers(all_in_stream, norm_share=0.0)
    reference = _noise_sqnr(plain, ids)
    assert abs(_noise_sqnr(model, ids) - reference) < 3
    assert _noise_sqnr(all_in_stream, ids) < reference - 5  # what the split avoids


def test_exact_plantings_leave_the_fp32_function_unchanged(small_model):
    plain, model = small_model(), small_model()
    planted = bench.plant_outliers(model, residual=False)
    assert planted["residual"] == [] and min(planted["mlp_factors"]) >= bench.OUTLIER_FACTORS[0]
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    _, before = _inputs_and_logits(plain, ids)
    inputs, after = _inputs_and_logits(model, ids)
    assert bench.fidelity(after, before)["sqnr_db"] > 80
    rms = inputs["layers.0.mlp.down_proj"].pow(2).mean(0).sqrt()
    assert (rms[planted["mlp"][0]] / rms.median() > 0.6 * bench.OUTLIER_FACTORS[0]).all()


def test_outliers_flag_is_listed_and_accepted(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "--outliers" in capsys.readouterr().out
    # Rows are checked before any checkpoint is built: an accepted flag reaches that check, a refused one would not.
    with pytest.raises(SystemExit) as exit:
        bench.main(["--random-weights", "--outliers", "--rows", "nope"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "unknown rows" in err and "unrecognized" not in err
    with pytest.raises(SystemExit):
        bench.main(["--model", "somewhere", "--outliers"])
    assert "--outliers plants outliers in the random weights" in capsys.readouterr().err


def test_concurrent_serves_a_crowd_through_the_batch_and_one_at_a_time(tiny_dir, tmp_path):
    out = tmp_path / "crowd.json"
    result = subprocess.run(
        [sys.executable, "-m", "qvl.bench", "--model", str(tiny_dir), "--rows", "auto", "--concurrent", "1,3",
         "--batch", "2", "--json", str(out)], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    crowds = json.loads(out.read_text())["rows"][0]["crowds"]
    # --batch 2: 1 and 3 together, then one a second; --batch 1: 1 and 3 together.
    assert [(c["batch"], c["count"], c["stagger_s"]) for c in crowds] == [
        (2, 1, 0.0), (2, 1, 1.0), (2, 3, 0.0), (2, 3, 1.0), (1, 1, 0.0), (1, 3, 0.0)]
    for c in crowds:
        assert c["aggregate_tok_s"] > 0 and 0 < c["ttft_p50_s"] <= c["ttft_p95_s"] < c["last_end_s"]
        assert 0 < c["longest_pause_s"] < c["last_end_s"] and 1 <= c["largest_batch"] <= c["batch"]
    assert crowds[2]["largest_batch"] == 2  # three arrivals, two seats
    assert crowds[3]["last_end_s"] >= 2.0  # the third arrived two seconds in
    assert crowds[0]["full_batch_tok_s"] > 0 and crowds[4]["full_batch_tok_s"] is None  # --batch 1 has no batch
    assert "| auto | 2 | 3 |" in result.stdout


@pytest.mark.parametrize("argv", [["--concurrent", "1,4", "--batch", "9"], ["--batch", "2"]])
def test_batch_takes_the_engine_s_seats_and_only_with_concurrent(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--random-weights", *argv])
    assert exit.value.code == 2 and "--batch takes 1 to 8 seats, with --concurrent" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["vnni"], indirect=True)
def test_step_overhead_computes_no_linear_where_vnni_takes_the_layers_in_one_call(onednn, kernels, tiny_dir):
    """The layers in one call (w8a14 on oneDNN's weights) read their weights inside the kernel: the stubbed step takes
    them one op at a time, so that no linear is computed in it."""
    model = checkpoint.load_model(str(tiny_dir), "w8a14")
    layers = len(model.model.language_model.layers)
    kernels[1].clear()
    split = bench.step_split(model, 20, steps=3)
    # The full way's first (untimed) step and the 3 timed ones, each in one call (the prompt's last row alone through
    # the head on its own); the stubbed steps' attention one op at a time, and torch's way none.
    assert kernels[1].count("decode") == 1 + 3 and kernels[1].count("linear") == 1
    assert kernels[1].count("attend") == 3 * layers and vnni.ready
    assert 0 < split["step_overhead_ms"] and 0 < split["step_ms"]
