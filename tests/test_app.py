"""The launched app through its `ask` API (gradio_client), as a script or another program would use it."""
import re
import threading
import time

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from qvl import settings
from qvl.engine.local import Engine
from qvl.serve.ui import ASSETS
from qvl.tools import stress
from test_engine import broken_copy

CHART = str(ASSETS / "chart.png")


@pytest.fixture(scope="module")
def app(launch_app):
    # Answers of exactly 160 tokens (1-3 s here): long enough to stream and to keep requests waiting behind them.
    with launch_app("--min-new-tokens", "160", "--max-new-tokens", "160", "--queue-size", "2") as running:
        yield running


def ask(client: Client, question: str, images=(), **params):
    return client.submit([handle_file(p) for p in images], question, api_name="/ask", **params)


def started(job, streaming: bool = False):
    """Wait until the job has sent something (its place in line), or with streaming, text of its answer."""
    while not job.outputs() or (streaming and not job.outputs()[-1][0]):
        assert not job.done(), job.exception()
        time.sleep(0.02)
    return job


def collect(job) -> list[tuple[float, str, str]]:
    """Every streamed (arrival time, answer, status) of a job, in order."""
    return [(time.monotonic(), answer, status) for answer, status, _ in job]


def test_an_image_question_is_answered_as_a_stream(app):
    updates = collect(ask(Client(app.url, verbose=False), "What does this chart show?", [CHART], use_cache=False))
    answers = [answer for _, answer, _ in updates if answer]
    assert len(answers) >= 3  # token by token, not all at once
    assert all(later.startswith(earlier) for earlier, later in zip(answers, answers[1:]))
    final_answer, final_status = updates[-1][1:]
    assert final_answer == answers[-1] != ""
    assert "first token" in final_status and "tok/s" in final_status and "answered from cache" not in final_status


def test_a_second_turn_carries_the_first_turns_image_until_a_new_conversation(app):
    client, short = Client(app.url, verbose=False), dict(use_cache=False, max_new_tokens=8, api_name="/ask")
    client.predict([handle_file(CHART)], "What does this chart show?", **short)
    _, follow_up, _ = client.predict([], "Which bar is the tallest?", **short)
    client.predict(api_name="/new_conversation")
    _, alone, _ = client.predict([], "Which bar is the tallest?", **short)
    assert "· 0 image tokens" not in follow_up and "image tokens" in follow_up
    assert "prompt tokens reused" in follow_up  # the first turn's attention cache was kept and reused
    assert "· 0 image tokens" in alone


def test_a_repeated_question_is_answered_from_the_cache(app):
    question = dict(question="Name them.", max_new_tokens=8, api_name="/ask")
    first = Client(app.url, verbose=False).predict([handle_file(CHART)], **question)
    again = Client(app.url, verbose=False).predict([handle_file(CHART)], **question)
    assert "answered from cache" not in first[1]
    assert again[0] == first[0] and "answered from cache" in again[1]


def test_an_empty_answer_comes_with_a_note_in_its_status_and_is_asked_again_not_cached(app):
    # Greedy, the tiny model writes only blank lines: nothing a user could read.
    question = dict(question="Say nothing?", greedy=True, max_new_tokens=8, api_name="/ask")
    first = Client(app.url, verbose=False).predict([handle_file(CHART)], **question)
    again = Client(app.url, verbose=False).predict([handle_file(CHART)], **question)
    for answer, status, _ in (first, again):
        assert not answer.strip()  # the model's text as it is, never a message in its place
        assert status.startswith("(the model gave no answer: rephrase the question, or press Retry")
        assert "tok/s" in status  # computed each time: an empty answer is not cached


def test_a_cached_answer_does_not_wait_behind_running_generations(app):
    clients = [Client(app.url, verbose=False) for _ in range(3)]
    clients[0].predict([handle_file(CHART)], "Count the bars.", api_name="/ask")
    running = started(ask(clients[0], "Describe the colours.", [CHART], use_cache=False))
    waiting = started(ask(clients[1], "Describe the axes.", [CHART], use_cache=False))
    _, status, _ = clients[2].predict([handle_file(CHART)], "Count the bars.", api_name="/ask")
    assert "answered from cache" in status
    assert not waiting.done()  # answered while two generations were still ahead of it
    collect(running), collect(waiting)


def test_a_second_client_waits_in_line_and_is_answered_once_the_first_is_done(launch_app):
    # Its own server, whose answers are 3000 tokens long unless a request asks for fewer: the first one is still being
    # answered when the second arrives, however fast the machine (160 tokens took 0.3 s on a Zen 5, less than the
    # second client took to join).
    with launch_app("--min-new-tokens", "3000", "--max-new-tokens", "3000") as app:
        first, second = Client(app.url, verbose=False), Client(app.url, verbose=False)
        running = started(ask(first, "What colour is the first bar?", [CHART], use_cache=False), streaming=True)
        waiting = started(ask(second, "What colour is the last bar?", [CHART], use_cache=False, max_new_tokens=8))
        assert "Waiting in line: 1 request(s) ahead" in waiting.outputs()[-1][1]
        time.sleep(0.5)
        assert not running.done() and not any(answer for answer, _, _ in waiting.outputs())  # still in line
        running.cancel()
        ended = time.monotonic()
        updates = collect(waiting)
        assert "first token" in updates[-1][2]
        assert all(arrived >= ended for arrived, answer, _ in updates if answer)


def test_a_stopped_answer_frees_the_worker_for_the_next_request(launch_app):
    # Its own server, whose answers are 3000 tokens long: the stopped one cannot finish first, however slow the machine.
    with launch_app("--min-new-tokens", "3000", "--max-new-tokens", "3000") as app:
        _stop_frees_the_worker(app)


def _stop_frees_the_worker(app):
    stopped = started(ask(Client(app.url, verbose=False), "Tell me everything.", [CHART], use_cache=False), True)
    waiting = started(ask(Client(app.url, verbose=False), "And now this.", [CHART], use_cache=False))  # in line
    stopped.cancel()
    started(waiting, streaming=True)  # the worker is free
    waiting.cancel()
    assert "first token" not in stopped.outputs()[-1][1]  # it never finished


def test_past_the_queue_bound_a_request_is_told_to_retry(launch_app):
    # Its own server, whose answers are 3000 tokens long unless a request asks for fewer: the first one still runs,
    # however fast the machine, while two short ones wait behind it, the bound of --queue-size 2.
    with launch_app("--queue-size", "2", "--min-new-tokens", "3000", "--max-new-tokens", "3000") as app:
        clients = [Client(app.url, verbose=False) for _ in range(4)]
        running = started(ask(clients[0], "Tell me everything.", [CHART], use_cache=False), streaming=True)
        short = dict(use_cache=False, max_new_tokens=8)
        waiting = [started(ask(client, f"Question {i}?", [CHART], **short)) for i, client in enumerate(clients[1:3])]
        with pytest.raises(AppError, match="busy"):
            clients[3].predict([handle_file(CHART)], "One too many?", **short, api_name="/ask")
        running.cancel()
        assert all("first token" in job.result(timeout=60)[1] for job in waiting)


def test_bad_input_gets_a_message_and_the_next_request_works(app):
    with pytest.raises(AppError, match="type a question or add an image"):
        Client(app.url, verbose=False).predict([], "", api_name="/ask")
    answer, _, _ = Client(app.url, verbose=False).predict([], "Hello?", use_cache=False, max_new_tokens=8,
                                                          api_name="/ask")
    assert answer


def test_the_api_names_its_two_endpoints_and_nothing_of_the_page(app):
    api = Client(app.url, verbose=False).view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == {"/ask", "/new_conversation"} and not api["unnamed_endpoints"]
    ask = api["named_endpoints"]["/ask"]
    assert [p["parameter_name"] for p in ask["parameters"]] == [
        "images", "question", "use_cache", "max_image_tokens", "max_new_tokens", "temperature", "top_p", "top_k",
        "greedy", "seed", "max_video_frames"]
    assert [r["label"] for r in ask["returns"]] == ["answer", "status", "boxes"]
    new = api["named_endpoints"]["/new_conversation"]
    assert new["parameters"] == [] and new["returns"] == []


def test_the_start_up_log_names_the_apps_own_flags(app):
    log = app.log.read_text()
    assert f"qvl is up: open http://127.0.0.1:{app.port}" in log
    assert "start with --share" in log and "share=True" not in log


@pytest.fixture(scope="module")
def ranked(launch_app):
    """A server whose line knows its users: vip is a --priority-users login. Answers run until stopped (3000 tokens)
    unless a request asks for fewer, so a test decides when the line moves."""
    users = ("ann", "bob", "cat", "vip")
    with launch_app("--auth", ",".join(f"{u}:{u}-pw" for u in users), "--priority-users", "vip", "--queue-size", "4",
                    "--min-new-tokens", "3000", "--max-new-tokens", "3000") as running:
        running.client = lambda user: Client(running.url, auth=(user, f"{user}-pw"), verbose=False)
        yield running


def test_a_priority_user_who_arrives_last_is_answered_before_the_others_waiting(ranked):
    # Long enough that one answer ends well after the one before it: the order is read from when each job's last
    # piece reaches this process, which a busy client thread can delay by tens of milliseconds.
    short = dict(use_cache=False, max_new_tokens=32)
    running = started(ask(ranked.client("ann"), "Tell me everything.", [CHART], use_cache=False), streaming=True)
    bob = started(ask(ranked.client("bob"), "What colour is the first bar?", [CHART], **short))
    cat = started(ask(ranked.client("cat"), "What colour is the last bar?", [CHART], **short))
    vip = started(ask(ranked.client("vip"), "How many bars?", [CHART], **short))
    assert "Waiting in line: 1 request(s) ahead" in vip.outputs()[-1][1]  # only the running answer is ahead of vip
    while "Waiting in line: 3 request(s) ahead" not in cat.outputs()[-1][1]:
        time.sleep(0.02)  # cat was 2nd in line; vip passed it, and cat's place says so
    running.cancel()
    finished = {}
    threads = [threading.Thread(target=lambda n=n, j=j: finished.__setitem__(n, collect(j)[-1][0]))
               for n, j in (("bob", bob), ("cat", cat), ("vip", vip))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(finished, key=finished.get) == ["vip", "bob", "cat"]
    assert all("first token" in job.outputs()[-1][1] for job in (bob, cat, vip))


def test_a_client_holds_one_place_in_line_and_gets_it_back_when_it_stops(ranked):
    ann, bob = ranked.client("ann"), ranked.client("bob")
    first = started(ask(ann, "Tell me everything.", [CHART], use_cache=False), streaming=True)
    with pytest.raises(AppError, match="one at a time"):
        ann.predict([handle_file(CHART)], "And this too?", use_cache=False, max_new_tokens=8, api_name="/ask")
    waiting = started(ask(bob, "Meanwhile, mine?", [CHART], use_cache=False, max_new_tokens=8))  # others still may
    assert "Waiting in line: 1 request(s) ahead" in waiting.outputs()[-1][1]
    first.cancel()
    # Stopped, ann may ask again at once, though the engine may still be finishing her stopped answer's step.
    _, status, _ = ann.predict([handle_file(CHART)], "Then this?", use_cache=False, max_new_tokens=8, api_name="/ask")
    assert "first token" in status and "first token" in waiting.result(timeout=60)[1]


def test_a_cache_hit_is_answered_at_once_even_for_a_client_already_in_line(ranked):
    ann, bob = ranked.client("ann"), ranked.client("bob")
    question = dict(question="Name the fruits.", use_cache=True, max_new_tokens=8, api_name="/ask")
    computed = ranked.client("cat").predict([handle_file(CHART)], **question)  # ann's conversation stays empty
    running = started(ask(bob, "Tell me everything.", [CHART], use_cache=False), streaming=True)
    waiting = started(ask(ann, "Describe the axes.", [CHART], use_cache=False, max_new_tokens=8))
    answer, status, _ = ann.predict([handle_file(CHART)], **question)  # ann's second request: no place, no wait
    assert answer == computed[0] and "answered from cache" in status
    assert not waiting.done() and "Waiting in line: 1 request(s) ahead" in waiting.outputs()[-1][1]
    running.cancel()
    assert "first token" in waiting.result(timeout=60)[1]


def test_a_second_start_reads_the_kept_model_while_the_app_imports(launch_app, tiny_dir, tmp_path):
    flags = ["--quant", "int8", "--model-cache-dir", str(tmp_path)]
    Engine(settings.parse(["--model", str(tiny_dir), "--no-cache", *flags], env={}))  # the first start: converts
    with launch_app(*flags) as second:
        stress.api_ready(second.url)
        _, status, _ = Client(second.url, verbose=False).predict([], "Hi", max_new_tokens=4, api_name="/ask")
    assert "tok/s" in status
    assert "from the model cache" in second.log.read_text() and "read ahead" in second.log.read_text()


def test_a_model_folder_without_a_checkpoint_stops_a_require_model_app_with_the_fixes(tmp_path):
    # --quant int8: the app first looks for a kept model to read ahead, which must leave the verdict to the engine.
    (tmp_path / "no-checkpoint").mkdir()  # a folder that does not exist is a usage error instead
    missing = str(tmp_path / "no-checkpoint")
    with pytest.raises(RuntimeError) as failed:
        stress.launch(missing, tmp_path, "--quant", "int8", "--require-model", "--model-cache-dir", str(tmp_path))
    assert "exited with 1" in str(failed.value) and "Fixes:" in str(failed.value), str(failed.value)[-2000:]


def test_weights_that_fail_to_load_after_the_page_is_up_stop_a_require_model_app_with_the_fixes(tiny_dir, tmp_path):
    # The checkpoint is found (the page goes up while its weights load), and only its weights file is broken.
    broken = str(broken_copy(tiny_dir, tmp_path / "broken"))
    try:
        server = stress.launch(broken, tmp_path, "--require-model")
    except RuntimeError as e:  # it failed before its page was up
        failed = str(e)
    else:
        server.proc.wait(timeout=120)
        failed = f"app.py exited with {server.proc.returncode}:\n{server.log.read_text()}"
    assert "exited with 1" in failed and "Fixes:" in failed and broken in failed, failed[-2000:]


STOPPED_WHILE_LOADING = """
import os, signal, sys, threading, time
import httpx, torch
from qvl.engine import modelcache
big = torch.ones(800, 800)
modelcache.load = lambda *a, **k: [big @ big for _ in range(100000)]  # a load inside torch, op after op: minutes
from gradio import networking
networking.url_ok = lambda url: False  # Gradio's look at its own page timing out, as it did once such a load began
import app
url = f"http://127.0.0.1:{sys.argv[3]}/"

def stop_once_the_page_serves():
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    body = {"model": "qvl", "messages": [{"role": "user", "content": "Hi"}]}
    refused = httpx.post(url + "v1/chat/completions", json=body, timeout=30).status_code
    print("page served, API while loading:", refused, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_the_page_serves, daemon=True).start()
sys.argv = ["app.py", "--model", sys.argv[1], "--quant", "fp32", "--no-cache", "--cache-dir", sys.argv[2],
            "--port", sys.argv[3]]
app.main()
"""


def test_an_app_stopped_while_its_weights_load_exits_at_once_and_cleanly(tiny_dir, tmp_path, python_child):
    # SIGTERM (or Ctrl+C) during a first start's minutes of converting: the load has no point to stop at.
    started = time.monotonic()
    child = python_child(STOPPED_WHILE_LOADING, tiny_dir, tmp_path, stress.free_port())
    assert "page served, API while loading: 503" in child.stdout, child.stderr[-3000:]
    assert child.returncode == 0 and "terminate called" not in child.stderr, child.stderr[-3000:]
    assert "exiting while the model loads or the kernels compile" in child.stderr and time.monotonic() - started < 90


START_TUNING = """
import gc, os, signal, sys, threading, time
import httpx
from qvl.engine import cpu, modelcache
import app
seen, load = [], modelcache.load
modelcache.load = lambda *a, **k: seen.append(sys.getswitchinterval()) or load(*a, **k)
collecting, release = [], cpu.release_collector
cpu.release_collector = lambda: collecting.append(gc.isenabled()) or release()
url = f"http://127.0.0.1:{sys.argv[3]}/"

def once_answering():
    body = {"model": "qvl", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    while True:
        try:
            if httpx.post(url + "v1/chat/completions", json=body, timeout=60).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    for _ in range(100):  # the ready event's thread restores it, a moment after
        if sys.getswitchinterval() == cpu.SERVING_SWITCH_S:
            break
        time.sleep(0.1)
    print("loading:", seen, "serving:", sys.getswitchinterval(), flush=True)
    print("collecting until the page:", collecting, "then:", gc.isenabled(), "frozen:", gc.get_freeze_count(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=once_answering, daemon=True).start()
sys.argv = ["app.py", "--model", sys.argv[1], "--quant", "int8", "--no-cache", "--cache-dir", sys.argv[2],
            "--model-cache-dir", sys.argv[2], "--port", sys.argv[3]]
app.main()
"""


def test_while_the_app_starts_the_gil_changes_hands_often_and_nothing_is_collected_both_as_usual_once_it_serves(
        tiny_dir, tmp_path, python_child):
    """The collector waits until the imports are done (the page is up), then leaves what they made out of its
    passes."""
    child = python_child(START_TUNING, tiny_dir, tmp_path, stress.free_port())
    assert "loading: [0.0005] serving: 0.005" in child.stdout, child.stdout + child.stderr[-3000:]
    collecting = re.search(r"collecting until the page: \[False\] then: True frozen: (\d+)", child.stdout)
    assert collecting and int(collecting[1]) > 100_000, child.stdout
    assert child.returncode == 0, child.stderr[-3000:]
