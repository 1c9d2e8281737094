import json
import math
import subprocess
import sys

import torch

from qvl import bench, settings


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
    from qvl import quant
    fp32 = bench.decode_bytes(quant.load_model(str(tiny_dir), "fp32")[0])
    int4 = bench.decode_bytes(quant.load_model(str(tiny_dir), "int4")[0])
    assert 0.1 * fp32 < int4 < 0.3 * fp32


def test_bench_smoke_on_the_tiny_model_writes_the_json_schema(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "qvl.bench", "--model", str(tiny_dir), "--rows", "fp32,auto,auto-warm", "--runs", "1",
         "--json", str(out), "--scenarios", "regenerate"], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["machine"]["bandwidth_gb_s"] > 0
    assert [r["name"] for r in data["rows"]] == ["fp32", "auto", "auto-warm"]
    for row in data["rows"]:
        assert {"ready_s", "load_s", "ttft_s", "decode_tok_s", "e2e_s", "peak_rss_gb", "sqnr_db", "kl",
                "top1_agreement", "step_ms", "step_overhead_ms"} <= set(row)
        assert row["new_tokens"] == bench.NEW_TOKENS and row["image_tokens"] == 300
        assert [s["name"] for s in row["scenarios"]] == ["regenerate"]
    assert math.isinf(data["rows"][0]["sqnr_db"]) and data["rows"][1]["sqnr_db"] < 60
    assert data["rows"][2]["sqnr_db"] == data["rows"][1]["sqnr_db"]  # the second start holds the same model
    assert "| fp32 |" in result.stdout and "| auto |" in result.stdout and "| auto | regenerate |" in result.stdout


def test_memory_scenarios_reuse_and_time_the_same_request_cold(engine):
    params = settings.GenParams(greedy=True, max_new_tokens=8, min_new_tokens=8)
    results = bench.scenarios(engine, bench.SCENARIOS, params)
    assert [r["name"] for r in results] == list(bench.SCENARIOS)
    for r in results:
        assert set(r) == {"name", "ttft_s", "cold_ttft_s", "reused_tokens", "cached_images"}
        assert r["ttft_s"] > 0 and r["cold_ttft_s"] > 0 and r["reused_tokens"] > 0
    prompt = engine._inputs([bench.Turn("user", bench.QUESTION, (bench.photo(),))], params)[0]["input_ids"].shape[1]
    assert results[-1]["reused_tokens"] == prompt - 1  # Regenerate: all but the last prompt token


def test_step_overhead_is_the_step_without_its_matmuls_and_leaves_the_model_as_it_was(engine, monkeypatch):
    turn = bench.Turn("user", bench.QUESTION, (bench.photo(),))
    params = settings.GenParams(greedy=True, max_new_tokens=8, min_new_tokens=8)
    before = list(engine.chat([turn], params))[:-1]
    calls = []
    linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(1) or linear(self, x))
    split = bench.step_split(engine.model, 20, steps=3)
    layers = len(engine.model.model.language_model.layers)
    # The prefill, the first (untimed) step and the 3 timed full steps call every text linear and the head once;
    # the 3 stubbed steps call none.
    assert len(calls) == (1 + 1 + 3) * (4 * layers + 1)
    assert split["step_ms"] > 0 and split["step_overhead_ms"] > 0
    assert not any("forward" in vars(m) for m in engine.model.modules())
    engine.forget()
    assert list(engine.chat([turn], params))[:-1] == before


def test_kernels_time_each_way_to_read_a_linear():
    rows = bench.kernels(out_features=64, in_features=128, copies=2, repeats=1)
    assert [r["kernel"] for r in rows] == ["fbgemm int8", "int4 g128, bf16 activations",
                                           "int8 weight-only, bf16 activations", "int8 weight-only, fp32 activations",
                                           "fp32"]
    assert all(r["ms"] > 0 and r["weights_gb_s"] > 0 for r in rows)


def test_the_kernels_flag_prints_its_table():
    result = subprocess.run([sys.executable, "-m", "qvl.bench", "--kernels"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| fbgemm int8 |" in result.stdout and "| fp32 |" in result.stdout and "torch 2" in result.stdout
