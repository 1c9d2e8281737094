"""The OpenAI chat API (/v1), through the official `openai` client, against the app on the tiny model."""
import asyncio
import base64
import contextlib
import http.server
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from gradio_client import Client, handle_file

from qvl import settings
from qvl.conversation import InputError
from qvl.serve import answers, cache, doors, links, openai_api, ui
from qvl.serve.ui import ASSETS
from qvl.tools import stress
from test_robustness import watch

ROOT = Path(__file__).resolve().parent.parent
KEY = "s3cret"  # the README's
CHART = ASSETS / "chart.png"


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def asking(text: str, *pictures: Path) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures]
            + [{"type": "text", "text": text}]}


def ready(url: str, key: str) -> openai.OpenAI:
    """A client of the app at url, once its engine has warmed up: the page serves before, the API says 503."""
    client = openai.OpenAI(base_url=url + "v1", api_key=key, max_retries=0)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "Ready?"}], max_tokens=1)
            return client
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "the engine never warmed up"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def app(launch_app):
    with launch_app("--api-key", KEY, "--allow-image-urls") as running:
        running.client = ready(running.url, KEY)
        yield running


def test_the_model_is_listed_by_its_name_not_its_path(app, tiny_dir):
    assert [m.id for m in app.client.models.list()] == [Path(tiny_dir).name]  # not the server's path to it


def test_an_image_in_a_data_url_is_answered_whole_with_usage(app, tmp_path):
    picture = stress.picture(tmp_path / "noise.png", 20, seed=1)
    reply = app.client.chat.completions.create(model="qvl", messages=[asking("What is this?", picture)],
                                               max_tokens=8)
    choice, used = reply.choices[0], reply.usage
    assert choice.message.role == "assistant" and choice.message.content
    assert getattr(choice.message, "reasoning_content", None) is None  # an Instruct model's answer: no reasoning
    assert used.prompt_tokens > 20 and 1 <= used.completion_tokens <= 8  # the 20 image tokens are in the prompt
    assert used.total_tokens == used.prompt_tokens + used.completion_tokens
    assert choice.finish_reason == ("length" if used.completion_tokens == 8 else "stop")
    assert "· 20 image tokens ·" in reply.qvl_status  # the page's stats line, as qvl's own field


def test_a_streamed_answer_comes_in_chunks_then_usage(app):
    chunks = list(app.client.chat.completions.create(
        model="qvl", messages=[asking("Describe the chart.", CHART)], max_tokens=48, seed=7, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2  # streamed, not all at once
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ends in (["length"], ["stop"]) and not chunks[-1].choices and chunks[-1].usage.completion_tokens <= 48


def test_a_follow_up_reuses_the_kept_conversation(app, tmp_path):
    question = asking("What is in this picture?", stress.picture(tmp_path / "new.png", 24, seed=2))
    first = app.client.chat.completions.create(model="qvl", messages=[question], max_tokens=8)
    follow_up = [question, first.choices[0].message, {"role": "user", "content": "And what colour is it?"}]
    second = app.client.chat.completions.create(model="qvl", messages=follow_up, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert "prompt tokens reused" in second.qvl_status


def test_a_repeat_is_answered_from_the_answer_cache(app):
    ask = dict(model="qvl", messages=[asking("Count the bars.", CHART)], max_tokens=8, seed=11)
    first, again = app.client.chat.completions.create(**ask), app.client.chat.completions.create(**ask)
    assert "answered from cache" not in first.qvl_status and "answered from cache" in again.qvl_status
    assert again.choices[0].message.content == first.choices[0].message.content


def test_a_stop_sequence_ends_the_answer_before_it(app):
    ask = dict(model="qvl", messages=[asking("Spell it out.", CHART)], max_tokens=24, temperature=0)
    whole = app.client.chat.completions.create(**ask).choices[0].message.content
    assert len(whole) >= 7
    stop = whole[5:7]
    for stream in (False, True):
        reply = app.client.chat.completions.create(**ask, stop=[stop], stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
            reply.choices[0].message.content
        assert text == whole[:whole.find(stop)]


@pytest.mark.parametrize("lang, ask, status, message", [
    ("en", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"a text file").decode()}}]}]),
     400, "image is not a picture this app can read"),
    ("zh-CN", dict(messages=[{"role": "user", "content": "x " * 2500}]), 400, "但此模型最多只能处理 4096 个"),
    ("en", dict(messages=[]), 400, "The request's 'messages' is missing or not valid."),
    ("en", dict(messages=[{"role": "user", "content": "Hi"}], temperature=3), 400, "'temperature' is missing"),
    ("en", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png,notbase64"}}]}]), 400, "'messages[0].content[0].image_url' is missing or not valid"),
    ("en", dict(messages=[{"role": "tool", "content": "Hi"}]), 400, "Unknown role 'tool'"),
])
def test_bad_requests_get_400_in_the_pages_wording(app, lang, ask, status, message):
    client = app.client.with_options(default_headers={"Accept-Language": lang})
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="qvl", **ask)
    assert refused.value.status_code == status and message in refused.value.message
    assert app.client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "Next?"}],
                                              max_tokens=2).choices  # and the server keeps serving


def test_the_context_overflow_has_openais_code(app):
    with pytest.raises(openai.BadRequestError) as refused:
        app.client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "x " * 2500}])
    assert refused.value.code == "context_length_exceeded" and "over the limit" not in refused.value.message
    assert "this model handles at most 4096" in refused.value.message


def test_the_key_is_required_when_set(app):
    client = openai.OpenAI(base_url=app.url + "v1", api_key="wrong", max_retries=0)
    for call in (client.models.list, lambda: client.chat.completions.create(
            model="qvl", messages=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            call()
    missing = httpx.post(app.url + "v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


def test_an_image_link_to_this_machine_is_never_fetched(app):
    link = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{app.url}favicon.ico"}}]}
    with pytest.raises(openai.BadRequestError, match="127.0.0.1 is a local or private address"):
        app.client.chat.completions.create(model="qvl", messages=[link])


def test_the_readme_examples_run(app):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### OpenAI chat API"):readme.index("### MCP")]
    start, python, curl = re.findall(r"```(?:bash|python)\n(.*?)```", section, re.S)[:3]
    assert start.strip() == f"QVL_API_KEY={KEY} python app.py"  # what the app fixture starts
    here = app.url.rstrip("/")
    done = subprocess.run([sys.executable, "-c", python.replace("http://127.0.0.1:7860", here)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cached_tokens=" in done.stdout and "CompletionUsage(" in done.stdout
    done = subprocess.run(["bash", "-c", curl.replace("http://127.0.0.1:7860", here)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("data: ") >= 3 and done.stdout.rstrip().endswith("data: [DONE]")


# In-process: the same Answerer as the page, so a waiting `ask` shows the line is shared and the engine is watched.


@contextlib.contextmanager
def serving(engine, tmp_path, *flags):
    """The page and the API around `engine`, in this process, like app.py serves them; yields their URL (and keeps
    the answerer as serving.answerer, for a test to watch its line)."""
    config = settings.parse(["--cache-dir", str(tmp_path / "answers"), "--port", str(stress.free_port()), *flags],
                            env={})
    answerer = serving.answerer = answers.Answerer(engine, cache.AnswerCache(config.cache_dir), config)
    demo = ui.build(answerer, config)
    demo.queue(default_concurrency_limit=1, max_size=config.queue_size).launch(
        server_name="127.0.0.1", server_port=config.port, prevent_thread_lock=True, quiet=True,
        auth=settings.credentials(config.auth) or None, **ui.page_assets(),
        app_kwargs={"routes": openai_api.routes(answerer, config), "middleware": doors.guard(config)})
    try:
        yield demo.local_url
    finally:
        demo.close()


def test_while_warming_up_the_api_says_503(make_engine, tmp_path):
    with serving(make_engine(), tmp_path) as url:  # a fresh engine: warm_up never ran
        client = openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=0,
                               default_headers={"Accept-Language": "zh-CN"})
        with pytest.raises(openai.InternalServerError, match="模型仍在加载或预热（正在预热：回答第一个问题……）") as refused:
            client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"


def test_a_client_with_retries_waits_out_the_warm_up(make_engine, tmp_path):
    engine = make_engine()
    with serving(engine, tmp_path) as url:
        client = openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=2)
        threading.Timer(1.0, engine.warm_up, ([], "Hi")).start()  # ready a second after the first try
        started = time.monotonic()
        reply = client.chat.completions.create(model="qvl", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens == 2 and time.monotonic() - started >= 4.5  # it waited Retry-After


def test_with_auth_each_user_is_a_key_and_links_are_refused_by_default(engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--auth", "ann:pw") as url:
        assert httpx.get(url + "v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "v1", api_key="ann:wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "v1", api_key="ann:pw", max_retries=0)
        assert client.models.list().data
        link = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
        with pytest.raises(openai.BadRequestError, match="does not download images from links"):
            client.chat.completions.create(model="qvl", messages=[link])


def test_past_the_line_429_and_a_client_that_leaves_frees_the_engine(engine, tmp_path, monkeypatch):
    engine.ready.set()
    runs = watch(monkeypatch, engine)
    with serving(engine, tmp_path, "--queue-size", "1", "--min-new-tokens", "3000", "--max-new-tokens", "3000") as url:
        client = openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=0)
        running = client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "Go on."}],
                                                 stream=True)
        next(c for c in running if c.choices and c.choices[0].delta.content)  # it streams
        waiting = Client(url, verbose=False).submit([handle_file(str(CHART))], "Me next?", use_cache=False,
                                                    api_name="/ask")
        while not waiting.outputs() or "Waiting in line" not in waiting.outputs()[-1][1]:
            time.sleep(0.02)  # the page's API waits in the same line
        with pytest.raises(openai.RateLimitError, match="The server is busy") as refused:
            client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "Me too?"}])
        assert refused.value.status_code == 429
        running.close()  # the client leaves mid-answer
        while not waiting.outputs()[-1][0]:
            time.sleep(0.02)  # the next in line streams: the engine is free
        waiting.cancel()
        assert runs[0]["closed"] and not runs[0]["finished"]  # the left answer was never completed


def test_a_key_holds_one_place_in_line_and_a_priority_users_key_goes_first(engine, tmp_path):
    engine.ready.set()
    flags = ("--auth", "ann:pw,bob:pw,cat:pw", "--priority-users", "cat", "--min-new-tokens", "3000",
             "--max-new-tokens", "3000")
    with serving(engine, tmp_path, *flags) as url:
        ann, bob, cat = (openai.OpenAI(base_url=url + "v1", api_key=f"{u}:pw", max_retries=0)
                         for u in ("ann", "bob", "cat"))
        question = [{"role": "user", "content": "Go on."}]
        running = ann.chat.completions.create(model="qvl", messages=question, stream=True)
        next(c for c in running if c.choices and c.choices[0].delta.content)  # ann's answer streams
        with pytest.raises(openai.RateLimitError, match="one at a time") as refused:
            ann.chat.completions.create(model="qvl", messages=[{"role": "user", "content": "And this?"}])
        assert refused.value.code == "one_at_a_time"
        finished = []

        def wait_for(client, name):
            client.chat.completions.create(model="qvl", messages=[{"role": "user", "content": name}], max_tokens=2)
            finished.append(name)

        line = serving.answerer.line
        waiting = []
        for name, client in (("bob", bob), ("cat", cat)):  # bob is in line before cat asks
            waiting.append(threading.Thread(target=wait_for, args=(client, name)))
            waiting[-1].start()
            deadline = time.monotonic() + 30
            while len(line.tickets) < len(waiting) + 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert [t.client for t in line.tickets] == ["key:ann:pw", "key:cat:pw", "key:bob:pw"]
        running.close()  # ann leaves: the line moves
        for thread in waiting:
            thread.join(timeout=60)
        assert finished == ["cat", "bob"]  # cat, a --priority-users login, went ahead of bob, who came first


# The guard on image links: unit tests, offline.


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "::1", "fe80::1%eth0", "fc00::1", "::ffff:127.0.0.1",
                                     "224.0.0.1"])
def test_local_private_and_link_local_addresses_are_not_public(address):
    assert not links.public(address)


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111"])
def test_global_addresses_are_public(address):
    assert links.public(address)


def test_a_name_resolving_to_loopback_is_refused_before_connecting():
    with pytest.raises(InputError, match="localhost is a local or private address"):
        asyncio.run(links.fetch("http://localhost:9/picture.png", 1 << 20))


@pytest.fixture
def web(monkeypatch):
    """A web server on 127.0.0.1 that the guard lets through (as if it were public): /redirect sends to 10.0.0.1,
    /big is 2 MB, /chart.png is the chart."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/big": b"\0" * (2 << 20), "/chart.png": CHART.read_bytes()}.get(self.path)
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "http://10.0.0.1/chart.png")
            else:
                self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(links, "public", lambda address: address == "127.0.0.1")
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_public_link_is_fetched_within_the_size_limit_and_a_redirect_is_checked_again(web):
    assert asyncio.run(links.fetch(f"{web}/chart.png", 1 << 20)) == CHART.read_bytes()
    with pytest.raises(InputError, match="10.0.0.1 is a local or private address"):
        asyncio.run(links.fetch(f"{web}/redirect", 1 << 20))
    with pytest.raises(InputError, match="is larger than 1 MB"):
        asyncio.run(links.fetch(f"{web}/big", 1 << 20))
    with pytest.raises(InputError, match="Could not download the image from 127.0.0.1"):
        asyncio.run(links.fetch(f"{web}/missing.png", 1 << 20))
