"""The launched app under bad input, load, faults and attack, through its real API: every request gets an answer,
a clear message or the busy message; none is lost, mixed up or cached when it failed; no file leaks; no one gets in
without the password, which never reaches the log."""
import contextlib
import json
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import diskcache
import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from qvl import settings
from qvl.conversation import Stats, Turn
from qvl.serve import answers, cache, ui
from qvl.settings import GenParams
from qvl.tools import stress
from test_inputs import UNREADABLE, bomb_png, scene

USER, PASSWORD = "tester", "s3cret-Pa55-do-not-log"
AUTH = (USER, PASSWORD)
QUEUE_SIZE = 2
SHORT = dict(use_cache=False, max_new_tokens=8)
# Sampled answers of the tiny model are visible text (a greedy one is blank lines, which the cache never stores).
SAMPLED = dict(use_cache=True, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=200, seed=3, api_name="/ask")


@pytest.fixture(scope="module")
def app(launch_app):
    with launch_app("--auth", f"{USER}:{PASSWORD}", "--queue-size", str(QUEUE_SIZE), "--max-file-size", "1mb") as running:
        yield running


def client(app, lang: str = "en-US") -> Client:
    return Client(app.url, auth=AUTH, verbose=False, headers={"Accept-Language": lang})


def entries(app) -> int:
    """Answers in the app's cache, read from this process as a second user of the directory."""
    return cache.AnswerCache(str(app.cache_dir)).info()["entries"]


def still_answers(app) -> str:
    answer, status, _ = client(app).predict([handle_file(str(picture(app, "good.png")))], "Still there?", **SHORT,
                                            api_name="/ask")
    assert "first token" in status
    return answer


def picture(app, name: str, image: Image.Image | None = None) -> Path:
    path = app.log.parent / name
    (image or scene()).save(path)
    return path


def refusal(app, question: str, files=(), lang: str = "en-US", **params) -> str:
    """The message the API user sees for a request that must not be answered; then the next request is answered."""
    before = entries(app)
    with pytest.raises(AppError) as refused:
        client(app, lang).predict([handle_file(str(f)) for f in files], question, use_cache=True, api_name="/ask",
                                  **params)
    still_answers(app)
    assert entries(app) == before  # the failed request left nothing in the cache
    return str(refused.value)


@pytest.mark.parametrize("name", UNREADABLE)
def test_an_unreadable_upload_gets_a_clear_message(app, name):
    make, expected = UNREADABLE[name]
    path = app.log.parent / name
    path.write_bytes(make())
    assert refusal(app, "What is this?", [path]).startswith(expected)


def test_a_decompression_bomb_upload_is_refused(app):
    path = app.log.parent / "huge.png"
    path.write_bytes(bomb_png(30000, 30000))
    assert "megapixels are accepted" in refusal(app, "What is this?", [path])


def test_an_upload_over_max_file_size_is_refused(app):
    path = picture(app, "big.png", Image.effect_noise((1024, 1024), 90).convert("RGB"))
    assert path.stat().st_size > 1024 * 1024
    assert refusal(app, "What is this?", [path]) == "big.png is larger than 1 MB; please upload a smaller picture."
    assert refusal(app, "这是什么？", [path], lang="zh-CN") == "big.png 大于 1 MB，请上传更小的图片。"


def test_a_refusal_speaks_chinese_to_a_chinese_browser_and_logs_one_line(app):
    make, _ = UNREADABLE["cut.jpg"]
    path = app.log.parent / "cut.jpg"
    path.write_bytes(make())
    log_before = app.log.read_text()
    message = refusal(app, "这是什么？", [path], lang="zh-CN")
    assert message == "cut.jpg 已损坏或不完整，请上传完整的图片。"  # PIL's own wording stays out of it
    added = app.log.read_text()[len(log_before):]
    refused = [line for line in added.splitlines() if "refused:" in line]
    assert len(refused) == 1 and "cut.jpg is damaged" in refused[0] and "truncated" in refused[0]
    assert "Traceback" not in added


def test_an_empty_message_a_200kb_question_and_too_many_images_are_refused(app):
    assert refusal(app, "") == "Please type a question or add an image."
    # The tiny model's own limit (4096) is below --max-context's default (8192): the message names the model's.
    assert "tokens, but this model handles at most 4096." in refusal(app, "Read this. " * 20_000)
    many = [picture(app, f"many{i}.png", scene(1024, 1024)) for i in range(5)]
    assert "(5120 of them for 5 images)" in refusal(app, "Compare.", many, max_image_tokens=1024)


def test_odd_unicode_and_lone_surrogates_from_raw_json_are_answered(app):
    with logged_in(app) as http:
        for question in ["שלום 👩‍👩‍👧‍👦 e\u0301\u0302 \u202eabc", "\ud83d\ude00 and a lone \ud800"]:
            events = call(http, stress.ask_data([], question, True, max_new_tokens=8))
            assert events[-1][0] == "complete", events[-1]


@contextlib.contextmanager
def logged_in(app):
    with httpx.Client(base_url=app.url, timeout=60) as http:
        http.post("login", data={"username": USER, "password": PASSWORD}).raise_for_status()
        yield http


def call(http, data: list) -> list[tuple[str, str]]:
    """The raw REST API: POST the inputs, then read the event stream to its end; [(event, data), ...]."""
    # json.dumps escapes surrogates as \\udXXX, as a browser's JSON.stringify does; httpx's json= would refuse them
    posted = http.post("gradio_api/call/ask", content=json.dumps({"data": data}),
                       headers={"content-type": "application/json"})
    if posted.status_code != 200:
        return [("rejected", posted.text)]
    events, name = [], None
    with http.stream("GET", f"gradio_api/call/ask/{posted.json()['event_id']}") as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name != "heartbeat":
                events.append((name, line[6:]))
    return events


def asked(seed: int) -> GenParams:
    """What the app makes of stress.ask's parameters."""
    return GenParams(**{k: v for k, v in stress.ASK.items() if k != "use_cache"} | {"seed": seed})


def expected(engine, turns, seed: int) -> str:
    *pieces, _ = engine.chat(turns, asked(seed))
    return "".join(pieces)


def test_load_is_answered_in_arrival_order_unmixed_and_past_the_bound_told_busy(app, engine):
    """A long answer holds the worker; QUEUE_SIZE clients wait in line, one more is told busy at once. When the long
    one's client leaves, the waiting are answered in order, each with its own conversation's answer."""
    clients = [client(app) for _ in range(QUEUE_SIZE + 1)]
    files = [stress.picture(app.log.parent / f"load{i}.png", 16 + i) for i in range(len(clients))]
    jobs, finished = [], []
    with logged_in(app) as http:
        data = stress.ask_data([], "Tell me a very long story.", False, max_new_tokens=2000, greedy=True)
        blocker = http.post("gradio_api/call/ask", json={"data": data}).json()["event_id"]
        with http.stream("GET", f"gradio_api/call/ask/{blocker}") as stream:
            lines = stream.iter_lines()  # kept: an abandoned iterator closes the connection
            assert "event: generating" in lines  # reads until the long answer streams
            for i, c in enumerate(clients):
                jobs.append(stress.ask(c, f"Client {i}: what is this?", [files[i]], seed=i))
                jobs[-1].add_done_callback(lambda _, i=i: finished.append(i))
                stress.wait_until_registered(jobs[-1])
            with pytest.raises(AppError, match=stress.BUSY):
                jobs[-1].result(timeout=60)
            assert finished == [QUEUE_SIZE]  # the others still wait
        # leaving the block drops the long answer's connection: the line moves on
    answers = [job.result(timeout=120) for job in jobs[:-1]]
    assert finished[0] == QUEUE_SIZE and sorted(finished[1:]) == list(range(QUEUE_SIZE))
    # The order they were answered in, as the server stored them: the order the clients' threads heard of it can
    # differ when answers take a few ms each (seen once in six runs on a 2-core Zen 5).
    store, firsts = cache.AnswerCache(str(app.cache_dir)), []
    for i, (answer, status, _) in enumerate(answers):
        first = Turn("user", f"Client {i}: what is this?", (str(files[i]),))
        firsts.append(store.get(store.key([first], asked(i), engine.identity)).created)
        assert answer == expected(engine, [first], seed=i)
        follow_up, status, _ = stress.ask(clients[i], "And what else?", seed=i).result(timeout=120)
        assert stress.image_tokens(status) == 16 + i
        assert follow_up == expected(engine, [first, Turn("assistant", answer), Turn("user", "And what else?")], i)
    assert firsts == sorted(firsts)  # answered in arrival order


def test_a_pickle_planted_in_the_cache_is_never_unpickled(app, engine, tmp_path):
    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    def key(question: str) -> str:
        params = replace(settings.GenParams(), max_new_tokens=8, greedy=True)  # what the app makes of the calls below
        return cache.AnswerCache(str(tmp_path / "scratch")).key([Turn("user", question)], params, engine.identity)

    stats = Stats(prompt_tokens=1, image_tokens=0, new_tokens=1, ttft_s=0.1, decode_tok_s=1.0, total_s=0.1,
                  stopped=False)
    with diskcache.Cache(str(app.cache_dir)) as planted:  # diskcache's default Disk pickles what is not plain data
        planted.set(key("Planted?"), json.dumps({"text": "PLANTED", "stats": asdict(stats), "created": 0.0}))
        planted.set(key("Unpickle me?"), Payload())
    ask = dict(images=[], use_cache=True, max_new_tokens=8, greedy=True, api_name="/ask")
    assert client(app).predict(question="Planted?", **ask)[0] == "PLANTED"  # the keys above are the app's
    answer, status, _ = client(app).predict(question="Unpickle me?", **ask)
    assert "first token" in status and "answered from cache" not in status
    assert not (tmp_path / "pwned").exists()


def test_a_broken_cache_directory_changes_nothing_for_users(app):
    question = dict(images=[handle_file(str(picture(app, "cached.png")))], question="Cache me.", **SAMPLED)
    answer, _, _ = client(app).predict(**question)
    assert "answered from cache" in client(app).predict(**question)[1]
    for what, damage in stress.CACHE_DAMAGE.items():
        damage(app.cache_dir)
        assert client(app).predict(**question)[0] == answer, what
        assert client(app).predict(**question)[0] == answer, what


TRAVERSALS = ["/etc/passwd", "../../../../../../etc/passwd", "/etc/hostname", str(ui.ASSETS / "chart.png")]


@pytest.mark.parametrize("path", TRAVERSALS + ["<outside.png>"])
def test_the_api_file_parameter_cannot_read_server_files(app, path):
    if path == "<outside.png>":  # a readable image the server has, but nobody uploaded
        path = str(picture(app, "outside.png"))
    with logged_in(app) as http:
        events = call(http, stress.ask_data([{"path": path, "meta": {"_type": "gradio.FileData"}}], "Describe it.",
                                            False, max_new_tokens=8, greedy=True))
    assert events[-1][0] in ("error", "rejected") and "first token" not in str(events)


@pytest.mark.parametrize("route", ["gradio_api/file=", "file=", "gradio_api/file/"])
@pytest.mark.parametrize("target", ["/etc/passwd", "../../../../etc/passwd", "%2e%2e/%2e%2e/etc/passwd", "app.py",
                                    "<cache db>"])
def test_the_file_routes_serve_nothing_outside_the_app(app, route, target):
    target = str(app.cache_dir / "cache.db") if target == "<cache db>" else target
    with logged_in(app) as http:
        response = http.get(route + target)
    assert response.status_code in (403, 404)
    assert "root:" not in response.text and "import" not in response.text


def test_the_password_is_required_and_never_logged(app):
    with pytest.raises(Exception):
        Client(app.url, verbose=False).predict([], "Let me in?", api_name="/ask")
    with pytest.raises(Exception):
        Client(app.url, auth=(USER, "wrong-guess-123"), verbose=False)
    assert httpx.get(app.url + "gradio_api/info").status_code in (401, 403)
    assert "first token" in client(app).predict([], "Hello?", **SHORT, api_name="/ask")[1]
    log = app.log.read_text()
    assert PASSWORD not in log and "wrong-guess-123" not in log


def test_the_default_bind_is_localhost(app, monkeypatch):
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    assert settings.parse([], env={}).host == "127.0.0.1"
    port = int(app.url.rsplit(":", 1)[1].strip("/"))
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port]
    assert listening == ["0100007F:%04X" % port]  # 127.0.0.1, little-endian as the kernel writes it


def test_sigterm_shuts_down_cleanly_and_frees_the_port(app):
    port, logged = int(app.url.rsplit(":", 1)[1].strip("/")), len(app.log.read_text())
    app.proc.send_signal(signal.SIGTERM)
    assert app.proc.wait(timeout=60) == 0
    assert stress.port_free(port)
    assert "Traceback" not in app.log.read_text()[logged:]


# Over time: what a long-running server keeps per visitor is bounded, in memory and on disk.


def image_tokens_seen(client: Client, question: str, files=()) -> int:
    """Ask, and return how many image tokens the model was given: the whole conversation's, as the server holds it."""
    _, status, _ = client.predict([handle_file(str(f)) for f in files], question, **SHORT, api_name="/ask")
    return stress.image_tokens(status)


def test_past_max_sessions_the_least_recently_active_conversation_is_forgotten(launch_app, tmp_path):
    with launch_app("--max-sessions", "2") as app:
        a, b, c = (Client(app.url, verbose=False) for _ in range(3))
        pictures = [stress.picture(tmp_path / f"session{n}.png", n) for n in (16, 17, 18)]
        assert image_tokens_seen(a, "A: what is this?", [pictures[0]]) == 16
        assert image_tokens_seen(b, "B: what is this?", [pictures[1]]) == 17
        assert image_tokens_seen(a, "A: and else?") == 16  # two conversations fit
        assert image_tokens_seen(c, "C: what is this?", [pictures[2]]) == 18  # a third: B, the least recent, goes
        assert image_tokens_seen(a, "A: still there?") == 16
        assert image_tokens_seen(b, "B: still there?") == 0  # B starts over, without its picture


def test_uploads_are_deleted_after_upload_hours_and_an_old_conversation_asks_for_them_again(launch_app, tmp_path):
    with launch_app("--upload-hours", "0.0015", GRADIO_TEMP_DIR=str(tmp_path / "uploads")) as app:  # 5.4 seconds
        client = Client(app.url, verbose=False)
        picture = stress.picture(tmp_path / "fleeting.png", 20)
        assert image_tokens_seen(client, "What is this?", [picture]) == 20
        stored = list((tmp_path / "uploads").rglob("fleeting.png"))
        assert stored, "the upload should be in Gradio's temp folder"
        deadline = time.monotonic() + 60
        while any(p.exists() for p in stored) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(p.exists() for p in stored)
        with pytest.raises(AppError, match="fleeting.png: file not found; please upload it again"):
            image_tokens_seen(client, "And now?")
        assert image_tokens_seen(Client(app.url, verbose=False), "Again:", [picture]) == 20


# In-process: the engine is this process's, so faults can be injected into it and its generations watched.


@pytest.fixture(scope="module")
def inproc(engine, tmp_path_factory):
    config = settings.parse(["--cache-dir", str(tmp_path_factory.mktemp("inproc") / "answers")], env={})
    demo = ui.build(answers.Answerer(engine, cache.AnswerCache(config.cache_dir), config), config)
    demo.queue(default_concurrency_limit=1, max_size=config.queue_size).launch(
        server_name="127.0.0.1", server_port=stress.free_port(), prevent_thread_lock=True, quiet=True)
    yield SimpleNamespace(url=demo.local_url, engine=engine)
    demo.close()


def watch(monkeypatch, engine) -> list[dict]:
    """Record each generation the app starts: pieces yielded, whether it finished, whether it was closed."""
    runs, chat = [], engine.chat

    def watched(turns, params=None):
        run = {"pieces": 0, "finished": False, "closed": False}
        runs.append(run)
        try:
            with contextlib.closing(chat(turns, params)) as inner:
                for item in inner:
                    run["pieces"] += 1
                    run["finished"] = not isinstance(item, str)  # the Stats come last, after the whole answer
                    yield item
        finally:
            run["closed"] = True

    monkeypatch.setattr(engine, "chat", watched)
    return runs


def test_a_client_that_disconnects_mid_answer_frees_the_worker(inproc, monkeypatch):
    runs = watch(monkeypatch, inproc.engine)
    stress.disconnect(inproc.url, None)  # asks for 2000 tokens, leaves after the first events
    deadline = time.monotonic() + 60
    while not (runs and runs[0]["closed"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runs[0]["closed"] and not runs[0]["finished"] and runs[0]["pieces"] < 2000
    answer, status, _ = Client(inproc.url, verbose=False).predict([], "Next?", **SHORT, api_name="/ask")
    assert "first token" in status and runs[-1]["finished"]


def test_a_generation_that_fails_midway_tells_the_user_and_the_next_works(inproc):
    calls = []

    def fail_on_the_third_step(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated fault in the model")

    question = dict(images=[], question="Fail half-way?", **SAMPLED)
    # The head runs once for the prompt and once per decode step: the third call is the second decode step.
    hook = inproc.engine.model.lm_head.register_forward_pre_hook(fail_on_the_third_step)
    try:
        with pytest.raises(AppError, match="Something went wrong while answering. Please try again."):
            Client(inproc.url, verbose=False).predict(**question)
    finally:
        hook.remove()
    assert len(calls) == 3
    answer, status, _ = Client(inproc.url, verbose=False).predict(**question)
    assert "first token" in status and "answered from cache" not in status  # the failed answer was not stored
    again, cached, _ = Client(inproc.url, verbose=False).predict(**question)
    assert again == answer and cached.startswith("answered from cache in")
