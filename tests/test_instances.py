"""Several apps on one machine (a front and its backend, workers, a test run beside a running app), all in the same
GRADIO_TEMP_DIR as a user's environment gives them: each keeps its uploads and example pictures to itself."""
import os
import signal
import subprocess
import sys

import httpx
import pytest
from gradio_client import Client, handle_file

from qvl.serve.ui import ASSETS
from qvl.tools import stress

CHART = str(ASSETS / "chart.png")
SHORT = dict(use_cache=False, max_new_tokens=8, api_name="/ask")


def example_urls(url: str) -> list[str]:
    """Where the page's example thumbnails are served, as the page's config names them."""
    chatbot = next(c for c in httpx.get(url + "config").json()["components"] if c["props"].get("elem_id") == "chatbot")
    return [file["url"] for example in chatbot["props"]["examples"] for file in example["files"]]


def test_an_app_that_stops_takes_nothing_from_another_app_beside_it(launch_app, tmp_path):
    shared = tmp_path / "gradio"
    with launch_app(GRADIO_TEMP_DIR=str(shared)) as a:
        client = Client(a.url, verbose=False)
        client.predict([handle_file(CHART)], "What does this chart show?", **SHORT)
        thumbnails = example_urls(a.url)
        with launch_app(GRADIO_TEMP_DIR=str(shared)) as b:  # the same picture, and the same examples
            Client(b.url, verbose=False).predict([handle_file(CHART)], "What does this chart show?", **SHORT)
            assert example_urls(b.url)
        _, status, _ = client.predict([], "Which bar is the tallest?", **SHORT)  # file not found: an AppError
        assert "image tokens" in status and "· 0 image tokens" not in status  # the chart is still part of it
        assert [httpx.get(url).status_code for url in thumbnails] == [200] * len(thumbnails)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl+C"])
def test_an_app_that_stops_leaves_nothing_in_the_temp_folder(launch_app, tmp_path, stop):
    shared = tmp_path / "gradio"
    with launch_app(GRADIO_TEMP_DIR=str(shared)) as app:
        Client(app.url, verbose=False).predict([handle_file(CHART)], "What does this chart show?", **SHORT)
        assert list(shared.rglob("chart.png"))  # the upload and the example, in the app's own folder
        app.proc.send_signal(stop)
        assert app.proc.wait(30) == 0
    assert list(shared.iterdir()) == []


def test_a_temp_folder_that_cannot_be_made_is_named_without_a_traceback(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QVL_", "GRADIO_"))}
    child = subprocess.run([sys.executable, str(stress.ROOT / "app.py")], capture_output=True, text=True, timeout=120,
                           env={**env, "GRADIO_TEMP_DIR": str(taken / "gradio")})
    assert child.returncode == 1 and "Traceback" not in child.stderr, child.stderr
    assert f"in {taken / 'gradio'} (Not a directory): set GRADIO_TEMP_DIR to a writable folder" in child.stderr
