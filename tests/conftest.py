import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from qvl import settings, tiny
from qvl.engine import Engine

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def engine(tiny_dir):
    return Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache"], env={}))


@pytest.fixture(scope="session")
def launch_app(tiny_dir, tmp_path_factory):
    """Start `python app.py` on the tiny model: `with launch_app("--queue-size", "2") as app: Client(app.url)`.

    The app gets a free port and its own cache folder; its output is in app.log. Leaving the block sends SIGTERM.
    """

    @contextlib.contextmanager
    def launch(*flags: str, timeout: float = 180):
        workdir = tmp_path_factory.mktemp("app")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QVL_", "GRADIO_"))}
        env["GRADIO_ANALYTICS_ENABLED"] = "False"  # tests run offline
        log = workdir / "app.log"
        command = [sys.executable, "app.py", "--model", str(tiny_dir), "--quant", "fp32", "--port", str(port),
                   "--cache-dir", str(workdir / "cache"), *flags]
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        app = SimpleNamespace(url=f"http://127.0.0.1:{port}/", process=process, log=log)
        try:
            deadline = time.monotonic() + timeout
            while not _answers(app.url):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"app.py did not start (exit {process.poll()}):\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            yield app
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    return launch


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
