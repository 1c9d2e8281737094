"""Image features kept per image: a picture seen before, even by another process, skips the vision tower, and a
damaged, missing or unusable store only costs a recomputation, never a wrong answer.

Engines here have conversation memory off, so only the feature store can spare the vision tower.
"""
import logging
import shutil
import threading
import time

import pytest

from qvl.conversation import Turn
from qvl.engine import features, heap
from test_engine import picture
from test_kv import ask, assert_same_answer, tower

QUESTION = [Turn("user", "What is in this picture?", (picture(),))]
OTHER = [Turn("user", "Which colours are there?", (picture(),))]


@pytest.fixture
def memoryless(make_engine):
    return lambda *flags: make_engine("--kv-memory", "0", *flags)


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_new_engine_on_the_same_folder_skips_the_vision_tower(memoryless, cold):
    first = memoryless()
    assert ask(first, QUESTION).stats.cached_images == 0
    restarted = memoryless()  # a restart, or another process sharing the folder
    calls = tower(restarted)
    answer = ask(restarted, OTHER)
    assert calls == [] and answer.stats.cached_images == 1 and answer.stats.reused_tokens == 0
    assert_same_answer(answer, ask(cold, OTHER))
    assert restarted.memory_info()["features"]["hits"] == 1


def test_features_are_kept_in_memory_too(memoryless):
    engine = memoryless()
    ask(engine, QUESTION)
    shutil.rmtree(engine.features.disk.directory)
    calls = tower(engine)
    assert ask(engine, OTHER).stats.cached_images == 1 and calls == []


def test_the_first_token_does_not_wait_for_the_store_which_has_the_features_once_the_answer_is_done(memoryless,
                                                                                                       monkeypatch):
    engine, events = memoryless(), []
    put = engine.features.put
    monkeypatch.setattr(engine.features, "put", lambda key, value: events.append("put") or put(key, value))
    for piece in engine.chat(QUESTION):
        events.append("piece")
    assert events.count("put") == 1 and 0 < events.index("put") < len(events) - 1  # after the first token, before Stats
    calls = tower(engine)
    assert ask(engine, OTHER).stats.cached_images == 1 and calls == []


def test_features_kept_in_memory_are_one_block_of_their_own_outside_the_heap(memoryless, monkeypatch):
    """heap.mapped: kept through many requests, in the heap an image's features would pin the memory that those
    requests' tensors free around them. As the tower computes them and as read back from disk."""
    blocks, mapped = [], heap.mapped
    monkeypatch.setattr(heap, "mapped", lambda shape, dtype: blocks.append(mapped(shape, dtype)) or blocks[-1])
    first = memoryless()
    ask(first, QUESTION)
    restarted = memoryless()
    assert ask(restarted, OTHER).stats.cached_images == 1  # read from disk
    starts = {block.untyped_storage().data_ptr() for block in blocks}
    for store in (first.features, restarted.features):
        assert store._memory
        for merged, deepstack in store._memory.values():
            storages = {t.untyped_storage().data_ptr() for t in (merged, *deepstack)}
            assert len(storages) == 1 and storages <= starts, "each image's features in one block of heap.mapped's"


def damage(folder, how):
    files = sorted(p for p in folder.rglob("*.val"))
    assert files, "the features were stored in files"
    for path in files:
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        path.write_bytes(data[: len(data) // 2] if how == "truncate" else data)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_entry_is_recomputed_with_one_warning(memoryless, cold, tmp_path, caplog, how):
    ask(memoryless(), QUESTION)
    damage(tmp_path / "cache" / "features", how)
    engine = memoryless()
    calls = tower(engine)
    answer = ask(engine, OTHER)
    assert len(calls) == 1 and answer.stats.cached_images == 0
    assert_same_answer(answer, ask(cold, OTHER))
    assert len(warnings_in(caplog)) == 1 and "damaged" in warnings_in(caplog)[0]
    again = memoryless()  # the recomputed features were written back
    calls = tower(again)
    assert ask(again, QUESTION).stats.cached_images == 1 and calls == []


def test_features_of_another_shape_are_refused(memoryless, cold, caplog):
    engine = memoryless()
    ask(engine, QUESTION)
    (key,) = list(engine.features._memory)
    merged, deepstack = engine.features._memory[key]
    engine.features.disk.write(key, features._encode((merged[:-1], [t[:-1] for t in deepstack])))
    restarted = memoryless()
    calls = tower(restarted)
    answer = ask(restarted, OTHER)
    assert len(calls) == 1 and "damaged" in " ".join(warnings_in(caplog))
    assert_same_answer(answer, ask(cold, OTHER))


def test_a_folder_deleted_while_running_is_started_afresh(memoryless, tmp_path):
    engine = memoryless()
    ask(engine, QUESTION)
    shutil.rmtree(tmp_path / "cache" / "features")
    ask(engine, [Turn("user", "And this?", (picture(96, 96),))])  # written to a new folder in its place
    restarted = memoryless()
    calls = tower(restarted)
    assert ask(restarted, [Turn("user", "Again?", (picture(96, 96),))]).stats.cached_images == 1 and calls == []


@pytest.mark.parametrize("fault", ["unusable folder", "disk full"])
def test_an_unusable_store_degrades_to_recomputing_with_one_warning(memoryless, cold, tmp_path, caplog, monkeypatch,
                                                                    fault):
    if fault == "unusable folder":
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "features").write_text("not a folder")  # root can write anywhere: chmod cannot do it
    else:
        monkeypatch.setattr("diskcache.Cache.set", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    engine = memoryless()
    for turns in (QUESTION, OTHER, [Turn("user", "A third?", (picture(128, 64),))]):
        answer = ask(engine, turns)
        assert_same_answer(answer, ask(cold, turns))
    assert len(warnings_in(caplog)) == 1 and "unusable" in warnings_in(caplog)[0]
    assert engine.memory_info()["features"]["error"]


def test_feature_cache_size_0_turns_the_store_off(memoryless, tmp_path):
    engine = memoryless("--feature-cache-size", "0")
    calls = tower(engine)
    for turns in (QUESTION, OTHER):
        assert ask(engine, turns).stats.cached_images == 0
    assert len(calls) == 2 and engine.memory_info()["features"] is None
    assert not (tmp_path / "cache" / "features").exists()


def test_memory_holds_what_its_bound_allows(memoryless):
    one = 2 * 80 * 64 * 4  # the tiny model's features of a 320x240 picture: merged and one deepstack layer, fp32
    engine = memoryless("--feature-cache-size", str(int(1.5 * one)))
    for color in ((1, 2, 3), (4, 5, 6), (7, 8, 9)):
        ask(engine, [Turn("user", "?", (picture(320, 240, color),))])
        info = engine.memory_info()["features"]
        assert info["memory_entries"] == 1 and info["memory_bytes"] <= info["memory_limit_bytes"]


def test_warm_up_answers_a_greeting_and_encodes_the_examples(memoryless):
    examples = [picture(320, 240, (250, 200, 0)), picture(96, 160)]
    engine = memoryless()
    assert not engine.ready.is_set()
    asked, chat = [], engine.chat
    engine.chat = lambda turns, params: asked.append(turns) or chat(turns, params)
    engine.warm_up(examples, "What is this?")
    assert engine.ready.is_set() and engine.memory_info()["features"]["disk_entries"] == 2
    # The short answer that initialises the decode path goes without a picture: a picture's prefill is seconds.
    assert [[turn.images for turn in turns] for turns in asked] == [[()]]
    calls = tower(engine)
    for example in examples:
        assert ask(engine, [Turn("user", "Describe it.", (example,))]).stats.cached_images == 1
    assert calls == []


def test_the_examples_are_encoded_once_ready_and_never_while_a_request_runs(memoryless):
    # A Space's disk does not persist: every restart encodes the examples again, which must not hold its first
    # answer back.
    engine, request = memoryless(), threading.Event()
    encoded, encode = [], engine._image_features
    engine._image_features = lambda *a: encoded.append((engine.ready.is_set(), request.is_set())) or encode(*a)
    greeting = engine.chat

    def visitor():  # a request that holds the engine for a second
        with engine._lock:
            request.set()
            time.sleep(1.0)
            request.clear()

    def chat(turns, params):  # the greeting, then at once a visitor's request
        yield from greeting(turns, params)
        threading.Thread(target=visitor).start()
        assert request.wait(10)

    engine.chat = chat
    engine.warm_up([picture(320, 240, (250, 200, 0)), picture(96, 160)], "What is this?")
    assert encoded == [(True, False), (True, False)]  # after ready, and after the request
    assert engine.memory_info()["features"]["disk_entries"] == 2


def _warming_slowly(engine) -> tuple[list, threading.Event, threading.Thread]:
    """The warm-up started in a thread, as the app starts it, with two pictures to encode, each vision block its
    encoding completes taking half a second more: (the engine lock's state after each, set once the first is done,
    the thread)."""
    blocks, started = [], threading.Event()

    def slow(*_):
        if threading.current_thread().name == "warm-up":
            blocks.append(engine._lock.locked())
            started.set()
            time.sleep(0.5)

    for block in engine.model.model.visual.blocks:  # the tiny model's two
        block.register_forward_hook(slow)
    warming = threading.Thread(target=engine.warm_up, name="warm-up",
                               args=([picture(320, 240, (250, 200, 0)), picture(96, 160)], "What is this?"))
    warming.start()
    return blocks, started, warming


def test_a_request_stops_the_background_encoding_at_its_next_block_and_the_picture_is_encoded_after(memoryless):
    engine = memoryless()
    blocks, started, warming = _warming_slowly(engine)
    assert started.wait(30)  # a first block of the first picture is done
    with engine._lock:  # a request: it gets the engine at once, and holds it
        time.sleep(1.5)
    warming.join(30)
    # The first picture was stopped after its first block, then encoded whole; never a block while the request ran.
    assert blocks == [False] * 5 and engine.memory_info()["features"]["disk_entries"] == 2


def test_an_exit_stops_the_background_encoding_at_its_next_block(memoryless):
    engine = memoryless()
    assert engine.settled.wait(300)  # numba's first compile, which an exit does not wait for either, is not timed here
    _, started, warming = _warming_slowly(engine)
    assert started.wait(30)
    began = time.monotonic()
    assert engine.close() and time.monotonic() - began < 1.5 and not warming.is_alive()
    assert engine.memory_info()["features"]["disk_entries"] == 0


def test_a_failed_warm_up_still_sets_ready(memoryless, monkeypatch, caplog):
    engine = memoryless()
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.model, "forward", broken)
    engine.warm_up([picture()], "What is this?")
    assert engine.ready.is_set() and "warming up failed" in caplog.text
