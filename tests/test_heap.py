import json
import threading
import time

import pytest

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import heap, local, quant

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


MALLINFO = """
import ctypes, json, torch
from qvl.engine import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

heap._LIBC.mallinfo2.restype = MallInfo2
"""

APART = MALLINFO + """
def blocks():  # malloc's heap blocks in use, and the blocks it mapped apart
    info = heap._LIBC.mallinfo2()
    return info.uordblks, info.hblkhd

heap.map_apart()
freed = torch.ones(20 << 20, dtype=torch.uint8)  # a block a load frees: glibc's own threshold would rise to 20 MB
del freed
before = blocks()
loading = torch.ones(3 << 20, dtype=torch.uint8)
during_load = blocks()
heap.hold_freed()
serving = torch.ones(3 << 20, dtype=torch.uint8)
print(json.dumps([before, during_load, blocks()]))
"""


def test_while_the_model_loads_large_blocks_are_mapped_apart_and_afterwards_requests_reuse_the_heap(python_child):
    """heap.map_apart, then hold_freed: a 3 MB tensor allocated while loading, after a 20 MB one was freed, gets
    pages of its own (a weight then leaves no hole in the heap; by default glibc would have raised its threshold past
    it), one allocated while serving comes from the heap (and its pages are kept for the next request's)."""
    child = python_child(APART)
    assert child.returncode == 0, child.stderr[-2000:]
    (heap0, apart0), (heap1, apart1), (heap2, apart2) = json.loads(child.stdout)
    assert apart1 - apart0 >= 3 << 20 and heap1 - heap0 < 1 << 20, "mapped apart while loading"
    assert heap2 - heap1 >= 3 << 20 and apart2 == apart1, "from the heap while serving"


MAPPED = MALLINFO + """
heap.hold_freed()

def megabytes():  # resident, and held by malloc (its heap's blocks in use and the blocks it mapped)
    info = heap._LIBC.mallinfo2()
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20, (info.uordblks + info.hblkhd) >> 20

start = megabytes()
tensor = heap.mapped((64, 1 << 20), torch.uint8)
tensor[:8] = 1
written = megabytes()
view = tensor[:8]
del tensor
assert view.sum() == 8 << 20
viewed = megabytes()
del view
print(json.dumps([start, written, viewed, megabytes()]))
"""


def test_a_mapped_tensor_is_outside_mallocs_heap_resident_where_written_and_handed_back_with_its_last_view(
        python_child):
    """heap.mapped, which holds the keys and values of answers and conversations and the image features kept in
    memory: 64 MB with 8 written is ~8 MB resident (what torch's first ops map besides), none of it malloc's; a view
    keeps it, and once the last one goes it leaves the process."""
    child = python_child(MAPPED)
    assert child.returncode == 0, child.stderr[-2000:]
    (rss, malloc), written, viewed, freed = json.loads(child.stdout)
    assert 7 <= written[0] - rss <= 16 and written[1] - malloc <= 1, (rss, malloc, written)  # not 64
    assert viewed[0] >= written[0] - 1 and viewed[0] - freed[0] >= 7, (written, viewed, freed)


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


def test_a_busy_server_trims_at_an_answers_end_once_it_has_grown_held_max_since_the_last_trim(tiny_dir, tmp_path,
                                                                                             monkeypatch):
    """A server that never idles for TRIM_IDLE_S still hands back what no request reuses: the answer that ends with
    the resident size over HELD_MAX above where the last trim left it trims; the one before it, under, does not."""
    engine = local.Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--cache-dir",
                                          str(tmp_path)], env={}))
    assert engine.settled.wait(60)
    base, here, real = engine._trimmed_at, threading.current_thread(), heap.resident
    assert base > 0
    # The resident size at the two answers' ends, then right after the trim (this thread's asks: the answers run in it).
    sizes = iter([base + local.HELD_MAX // 2, base + local.HELD_MAX + 1, base + local.HELD_MAX // 4])
    monkeypatch.setattr(heap, "resident", lambda: next(sizes) if threading.current_thread() is here else real())
    trims, trim = [], heap.trim
    monkeypatch.setattr(heap, "trim", lambda: trims.append(threading.current_thread()) or trim())
    params = settings.GenParams(max_new_tokens=2, greedy=True)
    list(engine.chat([Turn("user", "Hello?")], params))
    assert here not in trims
    list(engine.chat([Turn("user", "And then?")], params))
    assert trims.count(here) == 1 and engine._trimmed_at == base + local.HELD_MAX // 4
    engine.close()


HUGE_PAGES = """
import ctypes, json, mmap, zlib, torch
from qvl.engine import heap

def huge_kb(address):  # AnonHugePages of the mapping that holds address
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])

def resident_pages(address, size):
    pages = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
    assert heap._LIBC.mincore(address, size, pages) == 0
    return sum(b & 1 for b in pages)

probe = torch.ones(4 << 20, dtype=torch.uint8)
if not heap.huge_pages(probe.data_ptr(), probe.nbytes):
    print(json.dumps(None))  # no huge pages to move to here
    raise SystemExit
block = heap.mapped((16 << 20,), torch.uint8)
block[:8 << 20] = torch.arange(8 << 20) % 251  # a weight: written, then read
block[8 << 20::1 << 20] = 1  # a page a megabyte: a thread's stack, a KV buffer's room
address, crc = block.data_ptr(), zlib.crc32(block[:8 << 20].numpy())
stopped = heap.huge_pages_for_resident(lambda: False)
before = huge_kb(address)
moved = heap.huge_pages_for_resident()
print(json.dumps({"stopped": stopped, "before": before, "moved": moved, "after": huge_kb(address),
                  "same": zlib.crc32(block[:8 << 20].numpy()) == crc, "written": resident_pages(address, 8 << 20),
                  "sparse": resident_pages(address + (8 << 20), 8 << 20), "page": mmap.PAGESIZE}))
"""


def test_resident_memory_moves_to_huge_pages_unchanged_and_untouched_memory_stays_unallocated(python_child):
    """heap.huge_pages_for_resident, which the engine calls once its weights are in: a block of 16 MB with its first 8
    written (a weight) has the whole huge pages of its written half moved, its values unchanged, and its other half,
    a page written a megabyte, still those 8 pages in memory (a huge page there would add 2 MB each); a go_on that
    says stop moves nothing."""
    child = python_child(HUGE_PAGES)
    assert child.returncode == 0, child.stderr[-2000:]
    found = json.loads(child.stdout)
    if found is None:
        pytest.skip("this kernel cannot move memory to huge pages (Linux 6.1+ with transparent huge pages on)")
    spans = (8 << 20) // heap.HUGE - 1  # the whole huge pages inside 8 MB, wherever the block starts
    assert found["stopped"] == 0 and found["before"] == 0, found
    assert found["moved"] >= spans * heap.HUGE and found["after"] >= spans * heap.HUGE >> 10, found
    assert found["same"] and found["written"] == (8 << 20) // found["page"] and found["sparse"] == 8, found


def test_the_engine_moves_its_weights_to_huge_pages_once_they_are_in_and_before_it_has_settled(tiny_dir, tmp_path,
                                                                                              monkeypatch):
    """In the start's background work, after the int8 linears are repacked into the pieces they keep (what is
    resident then is the model as it serves), stopping for a request (the engine's idle test is its go_on)."""
    calls, move = [], heap.huge_pages_for_resident

    def spy(go_on):
        # The engine through its idle test: the settle thread may get here before the constructor has returned it.
        owner = getattr(go_on, "__self__", None)
        calls.append((owner.settled.is_set(), go_on, all(linear.merged == len(linear.parts)
                      for linear in owner.model.modules() if isinstance(linear, quant.Int8Linear))))
        return move(go_on)

    monkeypatch.setattr(heap, "huge_pages_for_resident", spy)
    engine = local.Engine(settings.parse(["--model", str(tiny_dir), "--quant", "w8a14", "--no-cache", "--cache-dir",
                                          str(tmp_path)], env={}))
    assert engine.settled.wait(120)
    assert calls == [(False, engine._idle, True)]
    engine.close()
