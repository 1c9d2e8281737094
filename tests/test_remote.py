"""A qvl that fronts another (--backend): two app processes, the second answering through the first's OpenAI API;
and what the remote engine says while it starts."""
import logging
import re
import shlex
import threading
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from qvl import settings, texts
from qvl.engine.remote import RemoteEngine
from qvl.serve.ui import ASSETS
from qvl.tools import stress
from test_openai_api import KEY, ready, serving
from test_robustness import watch

CHART = str(ASSETS / "chart.png")
SHORT = dict(use_cache=True, max_new_tokens=64, api_name="/ask")


def streamed(client: Client, question: str, images=(), **params) -> list[tuple[str, str]]:
    return list(client.submit([handle_file(p) for p in images], question, **{**SHORT, **params}))


def test_a_second_app_fronts_the_first_caches_its_answers_and_outlives_it(launch_app):
    # Answers of exactly 64 tokens from the first, so that each streams in several pieces.
    model_flags = ("--api-key", KEY, "--min-new-tokens", "64")
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = re.search(r"\n(QVL_BACKEND_KEY=\S+ python app.py --backend .*)\n", readme)[1]  # the README's, run here
    env, _, _, *flags = shlex.split(command.replace("7860", "{port}"))
    flags = flags[:flags.index("--port")]  # the test's own port instead
    with launch_app(*model_flags) as first:
        ready(first.url, KEY)
        flags = [flag.format(port=first.port) for flag in flags]
        with launch_app(*flags, "--concurrency", "2", QVL_BACKEND_KEY=env.split("=")[1],
                        PYTHONPROFILEIMPORTTIME="1") as second:
            client = Client(second.url, verbose=False)
            updates = streamed(client, "What does this chart show?", [CHART], seed=3)
            answers = [answer for answer, _, _ in updates if answer]
            assert len(answers) >= 2 and all(b.startswith(a) for a, b in zip(answers, answers[1:]))
            assert "first token" in updates[-1][1] and "· 300 image tokens ·" in updates[-1][1]
            _, follow_up, _ = client.predict([], "Which bar is the tallest?", **SHORT)
            assert "prompt tokens reused" in follow_up  # the first kept the conversation; its stats came through

            first.stop()
            again, status, _ = Client(second.url, verbose=False).predict(
                [handle_file(CHART)], "What does this chart show?", seed=3, **SHORT)
            assert "answered from cache" in status and again == answers[-1]  # the first is gone: the second's cache
            with pytest.raises(AppError, match="The model server cannot be reached right now"):
                Client(second.url, verbose=False).predict([], "Anyone there?", **SHORT)
            with pytest.raises(AppError, match="暂时无法连接模型服务器"):
                Client(second.url, verbose=False, headers={"Accept-Language": "zh-CN"}).predict(
                    [], "Anyone there?", **SHORT)

            with launch_app(*model_flags, port=first.port) as restarted:
                ready(restarted.url, KEY)
                answer, status, _ = Client(second.url, verbose=False).predict([], "Anyone there?", **SHORT)
                assert answer and "first token" in status  # recovered, the second never restarted
    imported = {line.rsplit("|", 1)[-1].strip() for line in second.log.read_text().splitlines()
                if line.startswith("import time")}
    assert "gradio" in imported and not {"torch", "transformers"} & imported
    assert "answer failed" not in second.log.read_text()  # a gone backend is no fault of the app's: no traceback
    named = re.search(r"backend \S+ serves (\S+)", second.log.read_text())  # learned at its warm-up
    assert named and named[1] != "?" and "model ?" not in second.log.read_text()


def ended(runs: list[dict], timeout: float = 60) -> dict:
    """The first generation `watch` saw, once it was closed; it must not have run to its end."""
    deadline = time.monotonic() + timeout
    while not (runs and runs[0]["closed"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runs and runs[0]["closed"] and not runs[0]["finished"]
    return runs[0]


def test_a_client_that_leaves_the_second_app_ends_the_generation_on_the_first(engine, tmp_path, monkeypatch,
                                                                              launch_app):
    # The first in this process, so its engine is watched; its answers are never shorter than the 2000 tokens asked
    # for, so only a closed stream ends one early.
    engine.ready.set()
    runs = watch(monkeypatch, engine)
    with serving(engine, tmp_path, "--min-new-tokens", "3000", "--max-new-tokens", "3000") as first, \
            launch_app("--backend", first + "v1") as second:
        stress.disconnect(second.url, None)  # asks the second's `ask` for 2000 tokens, leaves once they stream
        assert ended(runs)["pieces"] < 2000
        answer, status, _ = Client(second.url, verbose=False).predict([], "Next?", **{**SHORT, "max_new_tokens": 4})
        assert "first token" in status and runs[-1]["finished"]  # the first is free for the next question


def test_until_the_backend_names_its_model_the_banner_says_it_is_asking(monkeypatch):
    asked, answer = threading.Event(), threading.Event()

    def backend(request):
        asked.set()
        answer.wait(10)
        return httpx.Response(200, json={"data": [{"id": "served-model"}]})

    engine = RemoteEngine(settings.parse(["--backend", "http://backend.test/v1"], env={}))
    engine.http.close()
    engine.http = httpx.Client(transport=httpx.MockTransport(backend))
    warming = threading.Thread(target=engine.warm_up, args=([], "Hi"))
    warming.start()
    assert asked.wait(10)
    assert texts.starting("en", engine.progress()) == "Asking the model server which model it serves…"
    assert texts.starting("zh-CN", engine.progress()) == "正在询问模型服务器提供哪个模型……"
    answer.set()
    warming.join(10)
    assert engine.progress() is None and engine.model_id == "served-model"


def test_the_log_names_the_backends_model_once_the_backend_has_named_it(caplog):
    caplog.set_level(logging.INFO, "qvl")
    engine = RemoteEngine(settings.parse(["--backend", "http://backend.test/v1"], env={}))
    assert "backend http://backend.test/v1, model not known yet (asked at warm-up)" in caplog.text
    engine.http.close()
    engine.http = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, json={"data": [{"id": "served-model"}]})))
    engine.warm_up([], "Hi")
    assert "backend http://backend.test/v1 serves served-model" in caplog.text and "model ?" not in caplog.text
