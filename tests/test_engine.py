"""The engine: streaming answers about images, budgets, limits, stop and threads, on the tiny model."""
import itertools
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from PIL import Image

from qvl import images, settings
from qvl.conversation import InputError, Stats, Turn
from qvl.engine import jit, lean, local, modelcache
from qvl.engine.local import Engine, ModelUnavailable

GREEDY = settings.GenParams(greedy=True, max_new_tokens=24, min_new_tokens=24)


def picture(w=320, h=240, color=(200, 30, 30)):
    image = Image.new("RGB", (w, h), color)
    image.paste((20, 20, 220), (w // 4, h // 4, w // 2, h // 2))
    return image


def run(engine, turns, params=GREEDY):
    *pieces, stats = list(engine.chat(turns, params))
    assert isinstance(stats, Stats) and all(isinstance(p, str) for p in pieces)
    return pieces, stats


def test_streamed_pieces_join_to_the_answer_generate_would_give(engine):
    turns = [Turn("user", "What is in this picture?", (picture(),))]
    pieces, stats = run(engine, turns)
    assert len(pieces) > 1
    inputs, _ = engine._inputs(turns, GREEDY)
    with torch.inference_mode():
        out = engine.model.generate(**inputs, do_sample=False, max_new_tokens=24, min_new_tokens=24)
    expected = engine.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert stats.new_tokens == 24 and stats.truncated and not stats.stopped
    assert stats.prompt_tokens == inputs["input_ids"].shape[1]
    assert 0 < stats.ttft_s <= stats.total_s and stats.decode_tok_s > 0


def test_multi_turn_with_images_in_two_turns(engine):
    turns = [
        Turn("user", "Describe this.", (picture(320, 240),)),
        Turn("assistant", "A red square."),
        Turn("user", "And these two?", (picture(640, 480, (0, 128, 0)), picture(96, 96))),
    ]
    inputs, image_tokens = engine._inputs(turns, GREEDY)
    assert inputs["image_grid_thw"].shape[0] == 3
    pad = engine.model.config.image_token_id
    assert int((inputs["input_ids"] == pad).sum()) == image_tokens == 80 + 300 + 16  # 320x240 rounds to 320x256
    prompt = engine.processor.tokenizer.decode(inputs["input_ids"][0])
    assert prompt.count("<|vision_start|>") == 3 and "A red square." in prompt
    _, stats = run(engine, turns)
    assert stats.image_tokens == image_tokens


@pytest.mark.parametrize("size", [(640, 480), (4032, 3024), (1080, 1920), (1, 1), (33, 2000), (10000, 20)])
@pytest.mark.parametrize("budget", [64, 320, 1024])
def test_image_tokens_stay_within_budget_and_match_the_processor(engine, size, budget):
    params = replace(GREEDY, max_image_tokens=budget)
    inputs, image_tokens = engine._inputs([Turn("user", "?", (picture(*size),))], params)
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert image_tokens == t * h * w // 4 == int((inputs["input_ids"] == engine.model.config.image_token_id).sum())
    assert params.min_image_tokens <= image_tokens <= budget


def test_image_aspect_ratio_is_kept_when_resizing():
    w, h = images.fit(4032, 3024, 320, 16)
    assert w % 32 == h % 32 == 0 and abs(w / h - 4032 / 3024) < 0.1


def test_stop_ends_a_long_generation_early_and_the_next_request_runs(engine):
    long = replace(GREEDY, max_new_tokens=3000, min_new_tokens=3000)
    turns = [Turn("user", "Tell me everything.", (picture(),))]
    seen = threading.Event()
    result = {}

    def consume():
        for item in engine.chat(turns, long):
            seen.set()
            result["last"] = item

    worker = threading.Thread(target=consume)
    worker.start()
    assert seen.wait(60)
    engine.stop()
    worker.join(30)
    assert not worker.is_alive()
    stats = result["last"]
    assert stats.stopped and 0 < stats.new_tokens < 3000
    _, after = run(engine, turns)
    assert not after.stopped and after.new_tokens == 24


def test_closing_the_stream_frees_the_engine(engine):
    stream = engine.chat([Turn("user", "Go on.")], replace(GREEDY, max_new_tokens=3000, min_new_tokens=3000))
    next(stream)
    stream.close()  # what a disconnected client does
    _, stats = run(engine, [Turn("user", "Next?")])
    assert stats.new_tokens == 24


def test_thread_count_changes_reach_the_model_between_requests(engine):
    seen = []
    hook = engine.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        for n in (1, 2):
            engine.set_threads(n)
            seen.clear()
            run(engine, [Turn("user", "Hi")], replace(GREEDY, max_new_tokens=3, min_new_tokens=3))
            assert engine.threads == n and seen and set(seen) == {n}
    finally:
        hook.remove()
        engine.set_threads(engine.settings.threads)


def set_threads_elsewhere(engine, n: int):
    """engine.set_threads(n) in a thread of its own, as a server's settings tab calls it."""
    setter = threading.Thread(target=engine.set_threads, args=(n,))
    setter.start()
    setter.join()


def test_a_thread_count_set_in_one_thread_reaches_answers_resumed_in_threads_that_computed_before(engine,
                                                                                                 monkeypatch):
    """As a server runs them: the settings tab sets the count in one of its threads, and answers are resumed piece by
    piece in others, long-lived, that computed earlier answers (torch keeps a count per thread, which such a thread
    never takes from another's set_num_threads). The prefill and every decode step compute with the count set."""
    seen, step = [], lean.step
    hook = engine.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(lean, "step", lambda *args: seen.append(torch.get_num_threads()) or step(*args))
    workers = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]  # a server's: an answer's pieces in turn in each

    def answer():
        pieces = engine.chat([Turn("user", "Hi")], replace(GREEDY, max_new_tokens=6, min_new_tokens=6))
        for turn in itertools.cycle(workers):
            if isinstance(item := turn.submit(next, pieces).result(), Stats):
                return

    try:
        for n in (1, 2, 1):
            set_threads_elsewhere(engine, n)
            seen.clear()
            answer()
            assert engine.threads == n and len(seen) == 6 and set(seen) == {n}, (n, seen)
    finally:
        hook.remove()
        for worker in workers:
            worker.shutdown()
        engine.set_threads(engine.settings.threads)


def test_sampling_follows_the_seed(engine):
    params = settings.GenParams(max_new_tokens=16, min_new_tokens=16, seed=7)
    turns = [Turn("user", "Say something.")]
    first, again = run(engine, turns, params)[0], run(engine, turns, params)[0]
    other = run(engine, turns, replace(params, seed=8))[0]
    assert first == again and first != other


def test_too_long_conversation_is_refused_before_compute(engine):
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(InputError, match=f"this model handles at most {engine.max_context}"):
            next(engine.chat([Turn("user", "word " * engine.max_context)], GREEDY))
        many = tuple(picture(1024, 1024) for _ in range(20))
        with pytest.raises(InputError, match="image"):
            next(engine.chat([Turn("user", "?", many)], replace(GREEDY, max_image_tokens=1024)))
    finally:
        hook.remove()
    assert calls == []


def test_a_context_limit_below_the_models_is_named_as_the_servers(tiny_dir):
    small = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--max-context", "64"], env={}))
    with pytest.raises(InputError) as refused:
        next(small.chat([Turn("user", "word " * 80, (picture(),))], GREEDY))
    assert refused.value.key == "too_long" and " tokens (80 of them for 1 image), over the limit of 64 tokens." in \
        str(refused.value)
    assert "（其中 80 个用于 1 张图片），超过了 64 个 token 的上限" in refused.value.say("zh-CN")


def test_offline_fallback_serves_the_tiny_model(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("qvl.engine.local.TINY_DIR", tmp_path / "tiny")
    (tmp_path / "no-checkpoint").mkdir()  # a folder that does not exist is a usage error instead
    missing = str(tmp_path / "no-checkpoint")
    engine = Engine(settings.parse(["--model", missing, "--quant", "fp32"], env={}))
    assert engine.fallback and missing in engine.fallback
    assert "TINY OFFLINE MODEL" in caplog.text
    assert engine.model_id == str(tmp_path / "tiny")
    _, stats = run(engine, [Turn("user", "Hello?", (picture(),))])
    assert stats.new_tokens == 24


def test_require_model_turns_the_fallback_into_an_error_naming_the_fixes(tmp_path):
    (tmp_path / "no-checkpoint").mkdir()
    missing = str(tmp_path / "no-checkpoint")
    with pytest.raises(ModelUnavailable, match="folder that holds the checkpoint's config.json") as refused:
        Engine(settings.parse(["--model", missing, "--require-model"], env={}))
    assert "hf download" not in str(refused.value)  # a folder is not a hub id to download
    with pytest.raises(ModelUnavailable):
        Engine(settings.parse(["--model", missing], env={"QVL_REQUIRE_MODEL": "1"}))


def test_hub_id_without_network_or_local_copy_falls_back_at_once(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr("qvl.engine.local.TINY_DIR", tmp_path / "tiny")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    engine = Engine(settings.parse(["--quant", "fp32"], env={}))
    assert engine.fallback.startswith("could not load 'Qwen/Qwen3-VL-2B-Instruct'")
    assert "unreachable" in engine.fallback
    with pytest.raises(ModelUnavailable, match="`hf download Qwen/Qwen3-VL-2B-Instruct`"):  # a hub id is downloadable
        Engine(settings.parse(["--quant", "fp32", "--require-model"], env={}))


EXIT_WHILE_WARMING = """
import sys, threading, time, torch
from qvl import settings
from qvl.engine.local import Engine
engine = Engine(settings.parse(["--model", sys.argv[1], "--quant", "fp32", "--no-cache", "--cache-dir", sys.argv[2]],
                               env={}))
big = torch.ones(800, 800)
engine.model.model.language_model.layers[0].register_forward_pre_hook(
    lambda *_: [big @ big for _ in range(300)])  # the warm-up's prefill a while inside torch, op after op
threading.Thread(target=engine.warm_up, args=([], "Hi"), daemon=True).start()  # as the app starts it
time.sleep(0.5)
print("warming at exit:", not engine.ready.is_set())
"""


def test_an_exit_while_warming_up_waits_for_the_step_in_flight_instead_of_aborting(tiny_dir, tmp_path, python_child):
    # Ctrl+C or SIGTERM in the first seconds of the app: the warm-up thread was inside torch when Python finalized.
    child = python_child(EXIT_WHILE_WARMING, tiny_dir, tmp_path)
    assert "warming at exit: True" in child.stdout, child.stderr[-2000:]
    assert child.returncode == 0 and "terminate called" not in child.stderr, child.stderr[-2000:]


def test_an_exit_while_numba_compiles_asks_for_an_immediate_exit_instead_of_waiting_for_it(tiny_dir, tmp_path,
                                                                                          monkeypatch):
    # A first start's compile takes ~40 s on 2 cores and has no point to stop at: close() says so within its wait.
    compiling, done = threading.Event(), threading.Event()
    monkeypatch.setattr(jit, "warm", lambda cache_dir: compiling.set() or done.wait(60) and False)
    monkeypatch.setattr(local, "EXIT_WAIT_S", 0.5)
    engine = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--cache-dir",
                                    str(tmp_path)], env={}))
    assert compiling.wait(60)
    began = time.monotonic()
    assert engine.close() is False and time.monotonic() - began < 3
    done.set()


def broken_copy(tiny_dir, folder):
    """The tiny checkpoint with its weights file cut short: found at once, failing only once its weights load."""
    shutil.copytree(tiny_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    return folder


def test_a_background_engine_is_described_at_once_and_answers_once_its_weights_are_in(tiny_dir, engine, monkeypatch):
    release, real = threading.Event(), modelcache.load
    monkeypatch.setattr(modelcache, "load", lambda *a, **k: release.wait() and real(*a, **k))
    late = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--kv-memory", "0",
                                  "--feature-cache-size", "0"], env={}), background=True)
    assert not late.loaded.is_set() and not hasattr(late, "model") and late.progress() == ("loading", None)
    assert (late.identity, late.precision, late.max_context) == (engine.identity, engine.precision, engine.max_context)
    turns, answers = [Turn("user", "What is in this picture?", (picture(),))], []
    asking = threading.Thread(target=lambda: answers.append(run(late, turns)))
    asking.start()
    try:
        asking.join(1.0)
        assert asking.is_alive() and not answers  # the question waits for the weights
    finally:
        release.set()
    asking.join(60)
    assert late.loaded.is_set() and "".join(answers[0][0]) == "".join(run(engine, turns)[0])


def test_weights_that_fail_to_load_in_the_background_fall_back_to_the_tiny_model(tiny_dir, tmp_path, monkeypatch,
                                                                               caplog):
    monkeypatch.setattr("qvl.engine.local.TINY_DIR", tmp_path / "tiny")
    broken = str(broken_copy(tiny_dir, tmp_path / "broken"))
    late = Engine(settings.parse(["--model", broken, "--quant", "fp32", "--no-cache"], env={}), background=True)
    assert late._wait_loaded() and late.fallback and broken in late.fallback
    assert late.model_id == str(tmp_path / "tiny") and "TINY OFFLINE MODEL" in caplog.text
    assert run(late, [Turn("user", "Hello?")])[1].new_tokens == 24


BACKGROUND = """
import logging, sys, time
from qvl import settings
from qvl.engine.local import Engine
logging.basicConfig(level=logging.INFO)  # as the app logs
engine = Engine(settings.parse(["--model", sys.argv[1], "--quant", "fp32", "--no-cache", "--cache-dir", sys.argv[2],
                                *sys.argv[3:]], env={}), background=True)
time.sleep(30)
print("still running")
"""


def test_require_model_ends_the_process_when_its_weights_fail_to_load_in_the_background(tiny_dir, tmp_path,
                                                                                       python_child):
    broken = broken_copy(tiny_dir, tmp_path / "broken")
    child = python_child(BACKGROUND, broken, tmp_path, "--require-model")
    assert child.returncode == 1 and "still running" not in child.stdout, child.stderr[-2000:]
    assert "Fixes:" in child.stderr and str(broken) in child.stderr
