import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qvl import settings, stress, tiny
from qvl.engine import Engine


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def python_child():
    """python_child(script, *args): script run by a fresh Python that imports this checkout; output captured as text.

    For what only a process of its own shows: what it imported, and how it exits."""
    return lambda script, *args: subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})


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
