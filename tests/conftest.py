import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from qvl import settings
from qvl.engine import cpu, jit, modes, quant, tiny, vnni
from qvl.engine.local import Engine
from qvl.tools import bench, stress


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def thinking_dir(tmp_path_factory):
    """The tiny model with a Thinking model's template and <think> tokens (tiny.build's thinking)."""
    return tiny.build(tmp_path_factory.mktemp("thinking"), thinking=True)


def _small_model(seed=0):
    """The tiny checkpoint's classes at a width where residual outliers behave as at 2B (layers' writes dwarf the
    token table's entries): 512 hidden, 2 layers, fp32."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=300, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000, mrope_section=[8, 12, 12],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=512,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="session")
def small_model():
    """small_model(seed=0): a fresh _small_model."""
    return _small_model


@pytest.fixture(scope="session")
def loud_dir(tmp_path_factory):
    """(folder, planted): a checkpoint of the tiny one's tokenizer, processor and special tokens at _small_model's
    width, its text decoder given real checkpoints' activation outliers (bench.plant_outliers says where)."""
    from transformers import AutoConfig, GenerationConfig, Qwen3VLForConditionalGeneration

    folder = tiny.build(tmp_path_factory.mktemp("loud"))
    config, wide = AutoConfig.from_pretrained(folder), _small_model().config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rope_parameters"):
        setattr(config.text_config, key, getattr(wide.text_config, key))
    config.vision_config.out_hidden_size = wide.vision_config.out_hidden_size
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig.from_pretrained(folder)
    planted = bench.plant_outliers(model)
    model.save_pretrained(folder)
    return folder, planted


@pytest.fixture(scope="session")
def python_child():
    """python_child(script, *args): script run by a fresh Python that imports this checkout; output captured as text.

    For what only a process of its own shows: what it imported, and how it exits."""
    return lambda script, *args: subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})


@pytest.fixture(scope="session", autouse=True)
def numba_cache(tmp_path_factory):
    """One numba cache for the session, this process's and every app it starts: the decode kernels compile once
    (seconds), not in each app's background."""
    os.environ["NUMBA_CACHE_DIR"] = str(tmp_path_factory.mktemp("numba"))


@pytest.fixture(autouse=True)
def int8_kernel():
    """Int8 linears that a test builds without an engine are fbgemm's, whatever engine an earlier test started (an
    engine sets torch's quantized engine for its process: quant.use_kernel)."""
    quant.use_kernel("fbgemm")
    yield
    quant.use_kernel("fbgemm")


def _skip_without_onednn():
    if cpu.arm() or not modes.onednn_fits():
        pytest.skip("oneDNN's int8 kernel takes 8-bit activations only on CPUs with AVX-512 VNNI or AMX")


@pytest.fixture
def onednn():
    """Int8 linears the test builds are oneDNN's (skipped where this CPU cannot run them)."""
    _skip_without_onednn()
    quant.use_kernel("onednn")


@pytest.fixture
def quant_flags():
    """quant_flags(mode): an engine's flags for "w8a14" (fbgemm's int8 linears and an fp32 vision tower, whatever
    auto picks here), "w8a14+onednn" (oneDNN's, the test skipped where this CPU cannot run them) or
    "w8a14+bf16-vision" (the vision tower in bf16)."""
    def flags(mode: str) -> list[str]:
        mode, *variants = mode.split("+")
        if "onednn" in variants:
            _skip_without_onednn()
        return ["--quant", mode, "--int8-kernel", "onednn" if "onednn" in variants else "fbgemm",
                "--vision-dtype", "bf16" if "bf16-vision" in variants else "fp32"]
    return flags


@pytest.fixture(params=["torch", "jit"])
def kernels(request, engine, monkeypatch):
    """Decode on torch's ops, on qvl.engine.jit's numba kernels, or ("vnni") on those with w8a14's oneDNN decode rows
    through qvl.engine.vnni's kernel (skipped where this CPU cannot run it); gives the choice and the names of the
    kernels called (proof that they ran). No engine's background work may warm the kernels meanwhile: it would switch
    them on mid-test (an earlier test's engine, still warming, did so in a CI run), so the test holds warm()'s lock."""
    engine.settled.wait()
    assert jit.warm(engine.settings.cache_dir)
    if request.param == "vnni" and not (modes.onednn_fits() and not cpu.arm() and vnni.warm()):
        pytest.skip("qvl's decode kernel for oneDNN's weights needs AVX-512 VNNI, which this CPU lacks")
    ready, calls = threading.Event(), []
    if request.param != "torch":
        ready.set()
    monkeypatch.setattr(jit, "ready", ready)
    monkeypatch.setattr(vnni, "ready", request.param == "vnni")
    for module, name in ((jit, "attend"), (jit, "in_two_parts"), (jit, "levels"), (jit, "tensor_levels"), (jit, "norm"),
                         (jit, "rope"), (jit, "prompt_rope"), (jit, "vision_rope"), (vnni, "linear"), (vnni, "decode")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    with jit._warming:
        yield request.param, calls


@pytest.fixture(scope="session")
def engine(tiny_dir, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("engine-cache"))  # its image-feature store, not the user's
    return Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--cache-dir", cache_dir],
                                 env={}))


@pytest.fixture(scope="session")
def cold(tiny_dir):
    """The tiny model with conversation memory and the image-feature store off: every request computed in full."""
    return Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--kv-memory", "0",
                                  "--feature-cache-size", "0"], env={}))


@pytest.fixture
def make_engine(tiny_dir, tmp_path):
    """make_engine(*flags): a fresh tiny engine, reuse on unless flags say otherwise, its cache folder in tmp_path."""
    return lambda *flags: Engine(settings.parse(
        ["--model", str(tiny_dir), "--quant", "fp32", "--cache-dir", str(tmp_path / "cache"), *flags], env={}))


@pytest.fixture(scope="session")
def launch_app(tiny_dir, tmp_path_factory):
    """Start `python app.py` on the tiny model: `with launch_app("--queue-size", "2") as app: Client(app.url)`.

    Keyword arguments are environment variables for the app (GRADIO_TEMP_DIR="..."), on top of a clean environment.
    The app gets a free port (or `port`, to restart one where it was) and its own cache folder; its output is in
    app.log. Leaving the block sends SIGTERM.
    """

    @contextlib.contextmanager
    def launch(*flags: str, port: int | None = None, **extra_env: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QVL_", "GRADIO_"))}
        env.update(GRADIO_ANALYTICS_ENABLED="False", **extra_env)  # tests run offline
        try:
            server = stress.launch(str(tiny_dir), tmp_path_factory.mktemp("app"), *flags, env=env, clean_env=True,
                                   port=port)
        except RuntimeError as e:
            pytest.fail(str(e))
        try:
            yield server
        finally:
            server.stop(timeout=30)

    return launch
