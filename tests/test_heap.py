import time

import pytest

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import heap, local

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="glibc's heap only (macOS and musl have other allocators)")

# A request's tensors, freed, three times (glibc settles where it places them), then the same again: how many pages
# the last one faults in. "threads": each time two requests at once, each in a new thread, as a server's workers run
# them; "one": one malloc arena, as app.py and the bench start.
REQUESTS = """
import resource, sys, threading, torch
from qvl.engine import heap
way, where, arenas = sys.argv[1:]
if arenas == "one":
    heap.limit_arenas()
if way == "hold":
    heap.hold_freed()

def request(together=None):
    tensors = [torch.ones(n << 20, dtype=torch.uint8) for n in (3, 9, 20, 7, 12, 25, 1)]  # each page written
    if together:
        together.wait()  # both requests' tensors live at once
    del tensors

def requests():
    if where == "main":
        return request()
    together = threading.Barrier(2)
    workers = [threading.Thread(target=request, args=(together,)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

for _ in range(3):
    requests()
if way == "trim":
    heap.trim()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
requests()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(python_child, *args) -> int:
    child = python_child(REQUESTS, *args)
    assert child.returncode == 0, child.stderr[-2000:]
    return int(child.stdout)


def test_a_request_reuses_the_pages_the_last_one_freed_and_trim_hands_them_back(python_child):
    """77 MB of tensors is ~20k pages: handed back in between, the next request maps them all again; held, it maps
    none afresh, or one block's that glibc placed at the heap's top this time (6400 pages seen)."""
    held, trimmed = (faults(python_child, way, "main", "default") for way in ("hold", "trim"))
    assert trimmed > 15000 and held < trimmed / 2, (held, trimmed)


def test_requests_in_worker_threads_reuse_the_pages_too_with_one_arena(python_child):
    """With glibc's default a new thread's request may take an arena of its own, whose heap is unmapped once emptied,
    so held or not its tensors fault in again (2.8k-26k of ~39k pages seen, as glibc places them); with one arena
    (heap.limit_arenas) they reuse the main heap that hold_freed() keeps (0-5.7k seen)."""
    held, trimmed = (faults(python_child, way, "threads", "one") for way in ("hold", "trim"))
    assert trimmed > 30000 and held < trimmed / 3, (held, trimmed)


def test_the_engine_hands_freed_memory_back_once_nobody_has_asked_for_a_while(tiny_dir, tmp_path, monkeypatch):
    """Not after each answer (a follow-up would fault its tensors' pages in again), but TRIM_IDLE_S after the last
    one: two answers in a row give one trim, that long after the second."""
    engine = local.Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--cache-dir",
                                          str(tmp_path)], env={}))
    assert engine.settled.wait(60)  # the start's background work trims once, as it ends
    trims, trim_if_idle = [], engine._trim_if_idle
    # This engine's trims only: another engine of the session may trim meanwhile.
    monkeypatch.setattr(engine, "_trim_if_idle", lambda: trims.append(time.monotonic()) or trim_if_idle())
    monkeypatch.setattr(local, "TRIM_IDLE_S", 1.0)
    params = settings.GenParams(max_new_tokens=2, greedy=True)
    for question in ("Hello?", "And then?"):
        list(engine.chat([Turn("user", question)], params))
    ended = time.monotonic()
    assert trims == []
    deadline = ended + 30
    while not trims and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # a second timer, had the first answer's not been cancelled, would have fired by now
    assert len(trims) == 1 and trims[0] - ended >= 0.9, (trims, ended)
    engine.close()
