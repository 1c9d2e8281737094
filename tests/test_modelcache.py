import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
import zlib

import pytest
import torch
from safetensors import safe_open

from qvl import settings
from qvl.conversation import Turn
from qvl.engine import checkpoint, heap, modelcache, quant
from qvl.engine.local import Engine
from qvl.settings import GenParams

QUESTION = [Turn("user", "describe a red square")]
PARAMS = GenParams(greedy=True, max_new_tokens=12, min_new_tokens=12)


def _start(tiny_dir, mode, *flags):
    """An engine, once a first start has kept its converted model (in the background, once loaded)."""
    engine = Engine(_settings(tiny_dir, mode, *flags))
    assert engine.settled.wait(60)
    return engine


def _answer(engine):
    *pieces, stats = engine.chat(QUESTION, PARAMS)
    return "".join(pieces)


def _files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def converting(monkeypatch):
    """Counts the starts that converted the checkpoint instead of reading the model cache."""
    calls = []
    real = checkpoint.load_model
    monkeypatch.setattr(checkpoint, "load_model", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a16", "w8a14"])
def test_a_second_start_loads_the_kept_model_and_answers_the_same(tiny_dir, tmp_path, mode, converting, caplog):
    caplog.set_level(logging.INFO, "qvl")
    store = ["--model-cache-dir", str(tmp_path / "models")]
    first = _start(tiny_dir, mode, *store)
    [name] = _files(tmp_path / "models")
    assert len(converting) == 1 and name.startswith(f"{mode}-")
    assert name.endswith(".safetensors")
    assert f"converting the checkpoint to {mode}" in caplog.text  # a first start says it converts
    second = _start(tiny_dir, mode, *store)
    assert len(converting) == 1 and "from the model cache" in caplog.text  # read, not converted
    assert second.precision == first.precision and second.identity == first.identity
    assert _weight_parts(second) == _weight_parts(first)  # w8a14's first layers: two int8 rows a weight row
    assert _answer(second) == _answer(first)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # more rows than DECODE_ROWS: int4's prefill twin
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):
            assert torch.equal(second.model(input_ids=rows).logits, first.model(input_ids=rows).logits)


def test_a_first_start_announces_how_many_weights_it_converts_not_how_long(tiny_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, "qvl")
    _start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path))
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        weights = sum(torch.Size(f.get_slice(name).get_shape()).numel() for name in f.keys())
    assert f"converting the checkpoint to int8 ({weights:,} weights)" in caplog.text
    assert "minutes" not in caplog.text  # the tiny model converts in no time


def _weight_parts(engine):
    return {name: m.weight_parts for name, m in engine.model.named_modules() if isinstance(m, quant.Int8Linear)}


@pytest.mark.parametrize("first, then", [("int8", "w8a14"), ("w8a14", "int8")])
def test_int8_and_w8a14_keep_a_model_each_since_w8a14_holds_its_first_layers_in_two_parts(tiny_dir, tmp_path, first,
                                                                                       then, converting):
    store = ["--model-cache-dir", str(tmp_path / "models")]
    _start(tiny_dir, first, *store)
    switched = _start(tiny_dir, then, *store)
    assert len(converting) == 2 and _files(tmp_path / "models") == sorted(
        f"{mode}-{modelcache.weights_version(str(tiny_dir))}.safetensors" for mode in (first, then))
    assert switched.precision.startswith(then)
    assert set(_weight_parts(switched).values()) == ({1, 2} if then == "w8a14" else {1})
    assert _answer(_start(tiny_dir, then, *store)) == _answer(_start(tiny_dir, then, "--no-model-cache"))


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/maps")
@pytest.mark.parametrize("mode", ["int8", "w8a16"])
def test_a_loaded_model_maps_nothing_of_the_file_so_a_later_change_to_it_is_harmless(tiny_dir, tmp_path, mode,
                                                                                    converting):
    # The file is memory-mapped while it is read; were a page of it still mapped, touching it after the file was
    # truncated in place would kill the process (SIGBUS). The app keeps its read-ahead for as long as it runs.
    want = _answer(_start(tiny_dir, mode, "--model-cache-dir", str(tmp_path)))
    config = _settings(tiny_dir, mode, "--model-cache-dir", str(tmp_path))
    ahead = modelcache.read_ahead(config)
    engine = Engine(config, ahead)
    assert ahead is not None and engine.settled.wait(60)
    [file] = tmp_path.iterdir()
    assert len(converting) == 1 and str(file) not in open("/proc/self/maps").read()
    _truncate(file)
    assert _answer(engine) == want


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a16"])
def test_a_second_start_reads_the_loud_channels_that_the_first_found_and_answers_the_same(loud_dir, tmp_path, mode,
                                                                                            converting):
    store = ["--model-cache-dir", str(tmp_path / "models")]
    first = _start(loud_dir[0], mode, *store)
    second = _start(loud_dir[0], mode, *store)
    assert len(converting) == 1  # the second read the file: the calibration is not run again

    def apart(engine):
        return {name: (m.apart.tolist(), m.columns) for name, m in engine.model.named_modules()
                if getattr(m, "apart", None) is not None}
    assert list(apart(second)) == list(apart(first)) and len(apart(first)) == 8  # the planted model's text linears
    for (channels, columns), (want, want_columns) in zip(apart(second).values(), apart(first).values()):
        assert channels == want and torch.equal(columns, want_columns)
    ids = torch.tensor([list(range(1, 13))])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):
            assert torch.equal(second.model(input_ids=rows).logits, first.model(input_ids=rows).logits)
    assert _answer(second) == _answer(first)


def test_a_start_says_how_far_it_is_converting_first_then_reading(tiny_dir, tmp_path, monkeypatch):
    reports, real = [], Engine._report
    monkeypatch.setattr(Engine, "_report", lambda self, *now: reports.append(now) or real(self, *now))
    for phase in ("converting", "reading"):  # the first start, then the second
        reports.clear()
        engine = _start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path))
        assert {said for said, _ in reports} == {phase}
        done = [fraction for _, fraction in reports]
        assert len(done) > 10 and done == sorted(done) and done[0] < 0.5 and done[-1] == 1.0
        assert engine.progress() == ("warming", None)  # loaded; the warm-up is the app's to run
        engine.warm_up([], "Hi")
        assert engine.progress() is None


def _settings(tiny_dir, mode, *flags):
    """A start's settings; its vision tower in fp32 unless flags say otherwise, whatever auto picks here."""
    vision = [] if "--vision-dtype" in flags else ["--vision-dtype", "fp32"]
    return settings.parse(["--model", str(tiny_dir), "--quant", mode, "--no-cache", "--feature-cache-size", "0",
                           *vision, *flags], env={})


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a16"])
def test_a_start_handed_the_read_ahead_assembles_from_it_and_answers_the_same(tiny_dir, tmp_path, mode, monkeypatch):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, mode, *store))
    readers, taken = [], []
    real_init, real_take = modelcache.Reader.__init__, modelcache.Reader.take
    monkeypatch.setattr(modelcache.Reader, "__init__", lambda self, *a: readers.append(self) or real_init(self, *a))
    monkeypatch.setattr(modelcache.Reader, "take", lambda self, name: taken.append(self) or real_take(self, name))
    packers, side_by_side = [], checkpoint.side_by_side
    monkeypatch.setattr(checkpoint, "side_by_side", lambda jobs, workers=None: packers.append(workers) or side_by_side(
        jobs, workers))
    ahead = modelcache.read_ahead(_settings(tiny_dir, mode, "--threads", "1", *store))
    assert ahead is not None and ahead.file.parent == tmp_path and readers == [ahead]
    ahead.finish()
    assert packers == [1]  # the engine's threads, not every core torch sees before the engine sets them
    engine = Engine(_settings(tiny_dir, mode, *store), ahead)
    assert readers == [ahead] and set(taken) == {ahead}  # the stored file was read once, by the reader handed over
    assert _answer(engine) == want


def test_a_module_in_many_pieces_is_packed_by_every_worker_and_answers_the_same(tiny_dir, tmp_path, monkeypatch):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int8", *store))
    monkeypatch.setattr(quant, "PIECE", 64 * 8)  # the tiny model's linears are small: pieces of a few rows
    monkeypatch.setattr(modelcache, "MANY_PIECES", 4)
    packed, real = [], quant._pack
    monkeypatch.setattr(quant, "_pack", lambda w: packed.append(threading.current_thread().name) or real(w))
    engine = _start(tiny_dir, "int8", "--threads", "2", *store)
    assert any(name.startswith("pack") for name in packed) and any(name.startswith("convert") for name in packed)
    assert _answer(engine) == want



def _priority():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="Linux gives each thread a priority of its own")
def test_the_weights_are_read_packed_and_repacked_below_the_priority_of_the_page_and_the_requests(
        tiny_dir, tmp_path, monkeypatch):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int8", *store))
    monkeypatch.setattr(quant, "PIECE", 64 * 8)  # pieces, so that every kind of packing thread has work
    monkeypatch.setattr(modelcache, "MANY_PIECES", 4)
    packs, reads, pack, mapped = [], [], quant._pack, modelcache.Reader._mapped
    monkeypatch.setattr(quant, "_pack", lambda w: packs.append((threading.current_thread().name, _priority())) or
                        pack(w))
    monkeypatch.setattr(modelcache.Reader, "_mapped", lambda self: reads.append(_priority()) or mapped(self))
    engine = _start(tiny_dir, "int8", "--threads", "2", *store)
    assert engine.settled.wait(60)
    mine = _priority()  # the thread that builds the page and answers
    assert {name.rstrip("_0123456789") for name, _ in packs} == {"convert", "pack", "settle"}
    assert reads and all(priority > mine for priority in reads) and all(priority > mine for _, priority in packs)
    assert _answer(engine) == want


def test_a_start_from_the_model_cache_hands_what_each_layer_freed_back_as_it_goes(tiny_dir, tmp_path, monkeypatch):
    """As converting does: the reader trims the heap after each layer it builds, not once at the end."""
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int8", *store))
    trims, trim, build = [], heap.trim, modelcache.Reader._build
    monkeypatch.setattr(modelcache.Reader, "_build", lambda self, *args: trims.append("built") or build(self, *args))
    monkeypatch.setattr(heap, "trim", lambda: trims.append("trim") or trim())
    engine = _start(tiny_dir, "int8", *store)
    built, last = trims.count("built"), len(trims) - 1 - trims[::-1].index("built")
    # Before the last layer's building began, a trim for each layer built but the few still in flight.
    assert built > 10 and trims[:last].count("trim") >= built - 4, trims
    assert _answer(engine) == want


READ_AHEAD = """
import sys, torch
from qvl import settings
from qvl.engine import modelcache, quant
real, big = quant.Int8Linear.__init__, torch.ones(1500, 1500)
quant.Int8Linear.__init__ = lambda self, *a, **k: (big @ big, real(self, *a, **k))[1]  # each pack a while in torch
ahead = modelcache.read_ahead(settings.parse(["--model", sys.argv[1], "--quant", "int8", "--vision-dtype", "fp32",
                                              "--model-cache-dir", sys.argv[2]], env={}))
print("reading:", ahead is not None, "transformers imported:", any(m.startswith("transformers") for m in sys.modules))
if sys.argv[3] == "finish":
    print("read to the end, CRC-32 checked, tensors waiting:", len(ahead.finish()) > 0)
"""


@pytest.mark.parametrize("end", ["finish", "exit"])
def test_the_read_ahead_runs_without_transformers_and_an_exit_meanwhile_is_clean(tiny_dir, tmp_path, end,
                                                                                  python_child):
    # Without transformers, so that it runs while transformers imports; an exit (Ctrl+C while the app imports) stops
    # it between packs: a thread that came back from fbgemm while Python finalized would abort the process.
    _start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path))
    child = python_child(READ_AHEAD, tiny_dir, tmp_path, end)
    assert "reading: True transformers imported: False" in child.stdout, child.stderr[-2000:]
    assert ("tensors waiting: True" in child.stdout) == (end == "finish")
    assert child.returncode == 0 and "terminate called" not in child.stderr, child.stderr[-2000:]


def test_there_is_nothing_to_read_ahead_without_a_stored_model(tiny_dir, tmp_path):
    store = ["--model-cache-dir", str(tmp_path)]
    assert modelcache.read_ahead(_settings(tiny_dir, "int8", *store)) is None  # not converted yet
    # A folder without a checkpoint, a hub id never downloaded: the engine says why.
    for missing in (str(tmp_path), "no/such-hub-id"):
        assert modelcache.read_ahead(_settings(missing, "int8", *store)) is None
    _start(tiny_dir, "int8", *store)
    (ahead := modelcache.read_ahead(_settings(tiny_dir, "int8", *store))).close()
    assert ahead is not None
    assert modelcache.read_ahead(_settings(tiny_dir, "int8", "--no-model-cache", *store)) is None
    assert modelcache.read_ahead(_settings(tiny_dir, "fp32", *store)) is None
    assert modelcache.read_ahead(_settings(tiny_dir, "int4", *store)) is None  # no int4 model kept
    [file] = tmp_path.iterdir()
    _foreign(file)
    assert modelcache.read_ahead(_settings(tiny_dir, "int8", *store)) is None  # the engine says why, and rebuilds


def test_a_read_ahead_of_another_file_is_stopped_and_the_right_one_read(tiny_dir, tmp_path, caplog):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int4", *store))
    _start(tiny_dir, "int8", *store)
    ahead = modelcache.read_ahead(_settings(tiny_dir, "int8", *store))
    engine = Engine(_settings(tiny_dir, "int4", *store), ahead)
    assert ahead._closing.is_set() and not ahead._thread.is_alive()
    assert _answer(engine) == want and "ignoring" not in caplog.text


def test_a_second_start_serves_from_pieces_then_settles_to_the_same_answers(tiny_dir, tmp_path, monkeypatch):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int8", *store))
    monkeypatch.setattr(quant, "PIECE", 64 * 24)  # the tiny model's linears are small: pieces of a few rows
    settled = []
    real = quant.Int8Linear.settle
    monkeypatch.setattr(quant.Int8Linear, "settle", lambda self, *a: settled.append(real(self, *a)) or settled[-1])
    second = _start(tiny_dir, "int8", *store)
    assert second.settled.wait(60) and sum(settled) > 10  # most linears were in pieces, and were repacked
    assert all(len(m.parts) == 1 for m in second.model.modules() if isinstance(m, quant.Int8Linear))
    assert _answer(second) == want
    monkeypatch.setattr(quant.Int8Linear, "settle", lambda self, *a: False)  # pieces stay: they answer the same
    third = _start(tiny_dir, "int8", *store)
    assert any(len(m.parts) > 1 for m in third.model.modules() if isinstance(m, quant.Int8Linear))
    assert _answer(third) == want



def test_a_first_start_converts_into_pieces_then_keeps_and_settles_what_a_whole_conversion_would(
        tiny_dir, tmp_path, monkeypatch):
    whole = _start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path / "whole"))  # the tiny linears: one piece each
    monkeypatch.setattr(quant, "PIECE", 64 * 24)  # pieces of a few rows, as the 2B's linears are packed
    converted = checkpoint.load_model(str(tiny_dir), "int8")
    assert sum(len(m.parts) > 1 for m in converted.modules() if isinstance(m, quant.Int8Linear)) > 10
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):
            # No cache: the engine keeps keys and values in bf16 (--kv-dtype), which load_model's model does not.
            assert torch.equal(converted(input_ids=rows, use_cache=False).logits,
                               whole.model(input_ids=rows, use_cache=False).logits)
    pieces = _start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path / "pieces"))
    assert all(len(m.parts) == 1 for m in pieces.model.modules() if isinstance(m, quant.Int8Linear))  # settled
    [kept_whole], [kept_pieces] = ([*(tmp_path / name).iterdir()] for name in ("whole", "pieces"))
    assert kept_pieces.read_bytes() == kept_whole.read_bytes()
    assert _answer(pieces) == _answer(whole)


EXIT_WHILE_SETTLING = """
import sys, torch
from qvl import settings
from qvl.engine import quant
from qvl.engine.local import Engine
start = lambda: Engine(settings.parse(["--model", sys.argv[1], "--quant", "int8", "--no-cache",
                                        "--feature-cache-size", "0", "--model-cache-dir", sys.argv[2]], env={}))
start()  # converts and keeps the model
quant.PIECE = 64 * 24
real, big = quant.Int8Linear.settle, torch.ones(1500, 1500)
quant.Int8Linear.settle = lambda self, *a: (big @ big, real(self, *a))[1]  # each repack a while inside torch
print("settling at exit:", not start().settled.is_set())
"""


def test_an_exit_while_settling_waits_for_the_repack_in_flight_instead_of_aborting(tiny_dir, tmp_path, python_child):
    child = python_child(EXIT_WHILE_SETTLING, tiny_dir, tmp_path)
    assert "settling at exit: True" in child.stdout, child.stderr[-2000:]
    assert child.returncode == 0 and "terminate called" not in child.stderr, child.stderr[-2000:]

def test_the_weights_version_follows_the_weight_files_not_where_they_are(tiny_dir, tmp_path):
    hub = tmp_path / "models--Qwen--Qwen3-VL-2B-Instruct" / "snapshots" / ("0123456789abcdef" * 3)[:40]
    shutil.copytree(tiny_dir, hub)
    assert modelcache.weights_version(str(hub)) == modelcache.weights_version(str(tiny_dir))
    _corrupt(hub / "model.safetensors")
    assert modelcache.weights_version(str(hub)) != modelcache.weights_version(str(tiny_dir))


def test_checkpoints_that_differ_only_in_their_middle_layers_have_different_versions(tmp_path):
    """As a fine-tune of the same architecture does: every value of the middle tensors changed, the first and last MB
    of the file not (the random 2B with planted outliers once hashed as the plain one)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    layers = {f"layer{i}.weight": torch.randn(1024, 1024, dtype=torch.bfloat16) for i in range(5)}  # 2 MB each
    tuned = {name: tensor * 1.01 if name in ("layer1.weight", "layer3.weight") else tensor
             for name, tensor in layers.items()}
    for name, tensors in (("base", layers), ("tuned", tuned), ("copy", dict(layers))):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    version = {name: modelcache.weights_version(str(tmp_path / name)) for name in ("base", "tuned", "copy")}
    assert version["base"] == version["copy"] != version["tuned"]


def _corrupt(file):
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF  # one weight byte
    file.write_bytes(bytes(data))


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _foreign(file):
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["__metadata__"]["torch"] = "1.0.0"  # kept by another torch: its packed layouts may differ
    text = json.dumps(header).encode().ljust(size)
    file.write_bytes(data[:8] + text + data[8 + size:])


def _asymmetric(file):
    """One linear's zero points made non-zero, and the CRC-32 made to match: only what the data says spoils it (qvl's
    int8 weights are symmetric, and fbgemm's are packed as if they were)."""
    data = bytearray(file.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    zero_point = next(name for name in header if name.endswith(".zero_point"))
    data[8 + size + header[zero_point]["data_offsets"][0]] = 1
    header["__metadata__"]["crc32"] = f"{zlib.crc32(data[8 + size:]):08x}"
    file.write_bytes(bytes(data[:8]) + json.dumps(header).encode().ljust(size) + bytes(data[8 + size:]))


@pytest.mark.parametrize("spoil", [_corrupt, _truncate, _foreign, _asymmetric])
def test_a_spoiled_file_is_ignored_with_a_log_line_and_rebuilt(tiny_dir, tmp_path, spoil, converting, caplog):
    store = ["--model-cache-dir", str(tmp_path)]
    want = _answer(_start(tiny_dir, "int8", *store))
    [file] = tmp_path.iterdir()
    spoil(file)
    assert _answer(_start(tiny_dir, "int8", *store)) == want
    assert len(converting) == 2 and caplog.text.count("ignoring the model cache file") == 1
    assert _answer(_start(tiny_dir, "int8", *store)) == want
    assert len(converting) == 2  # the rebuilt file is good again


def test_an_unwritable_folder_only_costs_the_kept_copy(tiny_dir, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    engine = _start(tiny_dir, "int8", "--model-cache-dir", str(blocker / "models"))
    assert engine.fallback is None and _answer(engine)
    assert "could not keep the converted model" in caplog.text


def test_no_model_cache_writes_nothing_and_fp32_has_nothing_to_keep(tiny_dir, tmp_path, converting):
    _start(tiny_dir, "int8", "--no-model-cache", "--model-cache-dir", str(tmp_path / "a"))
    _start(tiny_dir, "fp32", "--model-cache-dir", str(tmp_path / "b"))
    assert _files(tmp_path / "a") == _files(tmp_path / "b") == []


def test_a_first_start_answers_before_its_converted_model_is_kept_which_happens_in_the_background(
        tiny_dir, tmp_path, monkeypatch):
    release, writes, write = threading.Event(), [], modelcache._write
    monkeypatch.setattr(modelcache, "_write", lambda *a: writes.append(_priority()) or release.wait(60) and write(*a))
    first = Engine(_settings(tiny_dir, "int8", "--model-cache-dir", str(tmp_path)))
    answer = _answer(first)  # keeping it waits: fbgemm unpacks every weight for it, a minute for the 2B
    assert first.loaded.is_set() and not first.settled.is_set() and _files(tmp_path) == []
    with first._lock:  # as a request does: the write waits for the cores and the memory
        release.set()
        time.sleep(1.0)
        assert not [name for name in _files(tmp_path) if name.endswith(".safetensors")]  # at most its .tmp
    assert first.settled.wait(60) and len(_files(tmp_path)) == 1 and writes[0] > _priority()
    assert _answer(_start(tiny_dir, "int8", "--model-cache-dir", str(tmp_path))) == answer


def test_an_exit_while_the_converted_model_is_kept_stops_the_write_and_leaves_no_file(tiny_dir, tmp_path,
                                                                                      monkeypatch, caplog):
    caplog.set_level(logging.INFO, "qvl")
    writing, tensors = threading.Event(), modelcache._tensors

    def slowly(model, data=True):  # a tenth of a second a tensor: ~10 s for the tiny model's
        for item in tensors(model, data):
            if data:
                writing.set()
                time.sleep(0.1)
            yield item

    monkeypatch.setattr(modelcache, "_tensors", slowly)
    engine = Engine(_settings(tiny_dir, "int8", "--model-cache-dir", str(tmp_path)))
    assert writing.wait(60)
    started = time.monotonic()
    assert engine.close() and engine.settled.is_set() and time.monotonic() - started < 2
    assert _files(tmp_path) == [] and "kept the converted" not in caplog.text


def test_a_crash_mid_write_leaves_no_file_a_later_start_trusts(tiny_dir, tmp_path, monkeypatch):
    model = checkpoint.load_model(str(tiny_dir), "int8")
    file = modelcache.path(str(tmp_path), "v", "int8")
    monkeypatch.setattr(modelcache.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        modelcache._write(file, model, modelcache.key("v", "int8"))
    assert _files(tmp_path) == []


def test_keeping_a_model_unpacks_its_int8_weights_a_piece_at_a_time(tiny_dir, tmp_path, monkeypatch):
    # Unpacked whole and joined, the 2B's head held 0.9 GB more for a moment, the peak of a first start.
    whole = checkpoint.load_model(str(tiny_dir), "int8")  # the tiny linears: one piece each
    monkeypatch.setattr(quant, "PIECE", 64 * 24)
    model = checkpoint.load_model(str(tiny_dir), "int8")
    alive, counts, real = weakref.WeakSet(), [], quant.Int8Linear.pieces

    def pieces(self):
        for piece in real(self):
            alive.add(piece)
            counts.append(len(alive))
            yield piece

    monkeypatch.setattr(quant.Int8Linear, "pieces", pieces)
    file = modelcache.path(str(tmp_path), "v", "int8")
    modelcache._write(file, model, modelcache.key("v", "int8"))
    assert len(counts) > 50 and max(counts) <= 2  # this piece, and the one before while it is let go
    modelcache._write(file.with_name("whole"), whole, modelcache.key("v", "int8"))
    assert file.read_bytes() == file.with_name("whole").read_bytes()


def test_a_write_removes_what_writes_by_processes_that_are_gone_left(tiny_dir, tmp_path):
    model = checkpoint.load_model(str(tiny_dir), "int8")
    file = modelcache.path(str(tmp_path), "v", "int8")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = (file.with_name(f"{file.name}.{pid}.tmp") for pid in (gone.stdout.strip(), os.getppid()))
    for left in (dead, live):
        left.write_bytes(b"half a model")
    modelcache._write(file, model, modelcache.key("v", "int8"))
    assert _files(tmp_path) == sorted([file.name, live.name])  # the live one may still be writing


def test_an_onednn_start_read_ahead_from_the_model_cache_answers_as_its_first_start(tiny_dir, tmp_path, quant_flags):
    """oneDNN's packing may keep the memory it packs from: a stored model's file, which the reader lets go once read."""
    store = ["--model-cache-dir", str(tmp_path), *quant_flags("w8a14+onednn")[2:]]
    want = _answer(_start(tiny_dir, "w8a14", *store))
    ahead = modelcache.read_ahead(_settings(tiny_dir, "w8a14", *store))
    assert ahead is not None
    engine = Engine(_settings(tiny_dir, "w8a14", *store), ahead)
    del ahead
    gc.collect()
    assert engine.settled.wait(60) and _answer(engine) == want
    assert {m.onednn for m in engine.model.modules() if isinstance(m, quant.Int8Linear)} == {True}


def test_each_vision_tower_has_a_file_of_its_own_and_a_later_start_answers_about_an_image_as_the_first(
        tiny_dir, tmp_path, converting):
    """A bf16 tower's vision linears are stored in another form (int8 weights that it reads as bf16), an int8 one's
    other parameters in bf16: a start with another tower converts its own, and each later start reads the one it
    needs."""
    from qvl.tools import bench

    request = [Turn("user", "what is this?", (bench.photo(),))]
    answers = {}
    for vision in ("bf16", "fp32", "int8") * 2:
        engine = _start(tiny_dir, "w8a14", "--model-cache-dir", str(tmp_path), "--vision-dtype", vision)
        *pieces, stats = engine.chat(request, PARAMS)
        assert answers.setdefault(vision, "".join(pieces)) == "".join(pieces)
        visual = engine.model.model.visual
        assert {type(m) for m in visual.modules() if isinstance(m, quant.Stored)} == (
            {quant.Int8WeightOnly} if vision == "bf16" else {quant.Int8Linear})
        assert visual.blocks[0].norm1.weight.dtype == (torch.float32 if vision == "fp32" else torch.bfloat16)
        engine.close()
    assert len(converting) == 3 and len(_files(tmp_path)) == 3
    assert {name.split("-")[0] for name in _files(tmp_path)} == {"w8a14", "w8a14+bf16", "w8a14+int8"}
