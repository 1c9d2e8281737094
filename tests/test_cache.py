import asyncio
import dataclasses
import json
import logging
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import diskcache
import pytest
from PIL import Image

from qvl import images, settings
from qvl.conversation import Stats, Turn
from qvl.images import ImageError
from qvl.serve import answers
from qvl.serve.cache import AnswerCache
from qvl.settings import GenParams
from qvl.sizes import parse_size

MODEL = "tiny@abc|fp32"
DONE = Stats(prompt_tokens=10, image_tokens=4, new_tokens=3, ttft_s=0.5, decode_tok_s=6.0, total_s=1.0, stopped=False)


@pytest.fixture
def photo(tmp_path) -> Path:
    rng = random.Random(0)
    path = tmp_path / "photo.png"
    Image.frombytes("RGB", (37, 23), bytes(rng.randrange(256) for _ in range(37 * 23 * 3))).save(path)
    return path


def ask(image, text="What is this?") -> list[Turn]:
    return [Turn("user", text, (image,))]


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qvl" and r.levelno == logging.WARNING]


def test_a_repeat_is_a_hit_with_the_identical_answer(engine, photo, tmp_path):
    cache = AnswerCache(tmp_path / "c")
    params = GenParams(max_new_tokens=8)
    key = cache.key(ask(photo), params, engine.identity)
    *pieces, stats = engine.chat(ask(photo), params)
    assert cache.get(key) is None
    assert cache.put(key, "".join(pieces), stats)
    hit = cache.get(key)
    assert hit.text == "".join(pieces)
    assert hit.stats == dataclasses.asdict(stats)
    assert cache.info()["hits"] == 1 and cache.info()["misses"] == 1 and cache.info()["entries"] == 1


def test_same_pixels_in_another_file_or_orientation_share_a_key(photo, tmp_path):
    cache = AnswerCache(tmp_path / "c")
    webp = tmp_path / "same.webp"
    Image.open(photo).save(webp, lossless=True)
    rotated = tmp_path / "rotated.png"  # stored turned, with an EXIF tag that turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(photo).transpose(Image.Transpose.ROTATE_90).save(rotated, exif=exif)
    sources = (photo, webp, rotated, photo.read_bytes(), images.open(rotated))  # the last decoded already
    keys = {cache.key(ask(source), GenParams(), MODEL) for source in sources}
    assert len(keys) == 1


def test_each_upload_is_decoded_and_hashed_once_for_the_key_and_the_engine(make_engine, photo, tmp_path, monkeypatch):
    """A miss: the answer cache's key, conversation memory and the image-feature store all key each upload by the one
    hash of its one decode."""
    other = tmp_path / "other.png"
    Image.new("RGB", (64, 48), (0, 90, 200)).save(other)
    turns = [Turn("user", "What is this?", (str(photo),)), Turn("assistant", "A photo."),
             Turn("user", "And this?", (str(other),))]
    engine, decoded, hashed = make_engine(), [], []
    load, digest = images.load, images._digest
    monkeypatch.setattr(images, "load", lambda source: decoded.append(source) or load(source))
    monkeypatch.setattr(images, "_digest", lambda image: hashed.append(image.size) or digest(image))
    answerer = answers.Answerer(engine, AnswerCache(tmp_path / "c"), settings.parse([], env={}))

    async def answer():
        return [u async for u in answerer.answer(turns, GenParams(greedy=True, max_new_tokens=4), True, False)]

    final = asyncio.run(answer())[-1]
    assert final.stats is not None and final.cached_in is None and answerer.cache.misses == 1
    assert decoded == [str(photo), str(other)] and hashed == [(37, 23), (64, 48)]
    assert engine.memory_info()["features"]["misses"] == 2 and engine.kv.info()["entries"] == 1


def test_one_changed_pixel_misses(photo, tmp_path):
    cache = AnswerCache(tmp_path / "c")
    changed = Image.open(photo).convert("RGB")
    r, g, b = changed.getpixel((5, 5))
    changed.putpixel((5, 5), (r ^ 1, g, b))
    assert cache.key(ask(photo), GenParams(), MODEL) != cache.key(ask(changed), GenParams(), MODEL)


def test_every_generation_setting_changes_the_key(photo, tmp_path):
    cache = AnswerCache(tmp_path / "c")
    base = GenParams()
    keys = {cache.key(ask(photo), base, MODEL)}
    for field in dataclasses.fields(GenParams):
        value = getattr(base, field.name)
        changed = not value if isinstance(value, bool) else value + 1 if isinstance(value, int) else value / 2
        keys.add(cache.key(ask(photo), dataclasses.replace(base, **{field.name: changed}), MODEL))
    assert len(keys) == 1 + len(dataclasses.fields(GenParams))


def test_conversation_and_model_identity_change_the_key(photo, tmp_path):
    cache = AnswerCache(tmp_path / "c")
    history = [Turn("user", "Hi"), Turn("assistant", "Hello."), Turn("user", "What is this?")]
    variants = [
        ask(photo),
        ask(photo, "What is this!"),
        [Turn("assistant", "What is this?", (photo,))],
        [Turn("user", "What is this?")],
        [Turn("user", "What is this?", (photo, photo))],
        [history[0], history[1], dataclasses.replace(history[2], images=(photo,))],
        [dataclasses.replace(history[0], images=(photo,)), history[1], history[2]],  # same image, earlier turn
    ]
    keys = {cache.key(turns, GenParams(), MODEL) for turns in variants}
    keys.add(cache.key(ask(photo), GenParams(), "tiny@abc|int8"))
    keys.add(cache.key(ask(photo), GenParams(), "tiny@abd|fp32"))
    assert len(keys) == len(variants) + 2


def test_an_unreadable_image_raises_the_engines_image_error(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(ImageError):
        AnswerCache(tmp_path / "c").key(ask(bad), GenParams(), MODEL)


def test_only_complete_answers_are_stored(tmp_path):
    cache = AnswerCache(tmp_path / "c")
    assert not cache.put("k", "half an answ", dataclasses.replace(DONE, stopped=True))
    assert not cache.put("k", "  ", DONE)
    assert cache.get("k") is None and cache.info()["entries"] == 0
    assert cache.put("k", "a truncated answer is complete for its max_new_tokens", dataclasses.replace(DONE, truncated=True))


def test_any_text_reads_back_unchanged(tmp_path):
    cache = AnswerCache(tmp_path / "c")
    for key, text in enumerate(("plain", "naïve 中文 🙂", "a lone surrogate \ud800 from a JSON escape")):
        assert cache.put(str(key), text, DONE)
        assert cache.get(str(key)).text == text


def test_entries_survive_a_restart(tmp_path):
    assert AnswerCache(tmp_path / "c").put("k", "answer", DONE)
    hit = AnswerCache(tmp_path / "c").get("k")
    assert hit.text == "answer" and hit.stats["new_tokens"] == DONE.new_tokens and hit.created > 0


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    big = "x" * 40_000  # over diskcache's 32 KiB threshold, so each answer is its own file of a known size
    roomy = AnswerCache(tmp_path / "c", "1GB")
    for name in ("a", "b", "c"):
        assert roomy.put(name, big + name, DONE)
    used = roomy.info()["size_bytes"]
    cache = AnswerCache(tmp_path / "c", used + 20_000)  # room for less than one more answer
    assert cache.get("a")  # "b" is now the least recently used
    assert cache.put("d", big + "d", DONE)
    assert cache.get("b") is None
    assert [cache.get(name).text[-1] for name in "acd"] == ["a", "c", "d"]
    assert cache.info()["size_bytes"] <= used + 20_000


def test_clear_empties_the_cache(tmp_path):
    cache = AnswerCache(tmp_path / "c")
    cache.put("k", "answer", DONE)
    cache.clear()
    assert cache.get("k") is None and cache.info()["entries"] == 0


def test_switched_off_it_neither_reads_nor_writes_nor_creates_its_folder(tmp_path):
    cache = AnswerCache(tmp_path / "c", enabled=False)
    assert not cache.put("k", "answer", DONE) and cache.get("k") is None
    assert not (tmp_path / "c").exists()
    cache.enabled = True  # the Settings tab switch
    assert cache.put("k", "answer", DONE) and cache.get("k").text == "answer"


def test_values_are_stored_as_json_and_pickles_are_never_loaded(tmp_path):
    cache = AnswerCache(tmp_path / "c")
    cache.put("small", "short answer", DONE)
    cache.put("large", "long answer " * 4000, DONE)  # stored as a file, not in SQLite
    with sqlite3.connect(tmp_path / "c" / "cache.db") as db:
        rows = db.execute("SELECT key, mode, filename, value FROM Cache").fetchall()
    records = {}
    for key, mode, filename, value in rows:
        assert mode in (diskcache.core.MODE_RAW, diskcache.core.MODE_TEXT)
        records[key] = json.loads(value if filename is None else (tmp_path / "c" / filename).read_text())
    assert records["small"]["text"] == "short answer" and records["large"]["stats"] == dataclasses.asdict(DONE)

    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return Path.touch, (marker,)

    diskcache.Cache(tmp_path / "c")["planted"] = Planted()
    assert cache.get("planted") is None
    assert not marker.exists()


def test_two_processes_share_one_directory(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys; from qvl.serve.cache import AnswerCache; from qvl.conversation import Stats\n"
            "DONE = Stats(1, 0, 1, 0.1, 1.0, 0.1, stopped=False)\n"
            "cache = AnswerCache(sys.argv[1]); print('ready', flush=True)\n"
            "assert all(cache.put(f'child{i}', f'c{i}', DONE) for i in range(300))\n"
        ), str(tmp_path / "c")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert child.stdout.readline() == "ready\n"
    cache = AnswerCache(tmp_path / "c")
    assert all(cache.put(f"parent{i}", f"p{i}", DONE) for i in range(300))
    assert child.wait(timeout=60) == 0
    fresh = AnswerCache(tmp_path / "c")
    assert fresh.info()["entries"] == 600
    assert all(fresh.get(f"child{i}").text == f"c{i}" and fresh.get(f"parent{i}").text == f"p{i}" for i in range(300))


def assert_degrades_with_one_warning(cache, caplog):
    for _ in range(3):
        assert cache.get("k") is None
        assert not cache.put("k", "answer", DONE)
    assert cache.info()["error"]
    assert len(warnings_in(caplog)) == 1


# Tests run as root, where chmod cannot make a folder unwritable: a cache.db that is a folder, or a cache
# folder that is a file, fail the same way an unwritable one does (SQLite cannot open the database).
@pytest.mark.parametrize("break_it", ["cache.db is a folder", "the folder is a file"])
def test_an_unusable_folder_degrades_gracefully(tmp_path, caplog, break_it):
    if break_it == "cache.db is a folder":
        (tmp_path / "c" / "cache.db").mkdir(parents=True)
    else:
        (tmp_path / "c").write_text("")
    assert_degrades_with_one_warning(AnswerCache(tmp_path / "c"), caplog)


def test_a_corrupted_database_degrades_gracefully_at_start_and_while_running(tmp_path, caplog):
    running = AnswerCache(tmp_path / "c")
    running.put("k", "answer", DONE)
    with sqlite3.connect(tmp_path / "c" / "cache.db") as db:  # answers move from the journal into cache.db
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(tmp_path / "c" / "cache.db", "r+b") as f:
        f.write(random.Random(0).randbytes(8192))
    assert_degrades_with_one_warning(running, caplog)
    caplog.clear()
    assert_degrades_with_one_warning(AnswerCache(tmp_path / "c"), caplog)


def test_a_folder_deleted_while_running_is_started_afresh(tmp_path, caplog):
    cache = AnswerCache(tmp_path / "c")
    cache.put("k", "answer", DONE)
    shutil.rmtree(tmp_path / "c")
    assert cache.get("k") is None
    assert cache.put("k2", "new answer", DONE)
    assert AnswerCache(tmp_path / "c").get("k2").text == "new answer"  # really on disk, not in a deleted file
    assert len(warnings_in(caplog)) == 1 and cache.info()["error"] is None


def test_a_folder_deleted_and_replaced_by_a_file_degrades_gracefully(tmp_path, caplog):
    cache = AnswerCache(tmp_path / "c")
    cache.put("k", "answer", DONE)
    shutil.rmtree(tmp_path / "c")
    (tmp_path / "c").write_text("")
    assert_degrades_with_one_warning(cache, caplog)


def test_clear_retries_a_repaired_folder(tmp_path):
    (tmp_path / "c").write_text("")
    cache = AnswerCache(tmp_path / "c")
    assert cache.info()["error"]
    (tmp_path / "c").unlink()
    cache.clear()
    assert cache.info()["error"] is None and cache.put("k", "answer", DONE)


@pytest.mark.parametrize("text, size", [("500MB", 500 << 20), ("2GB", 2 << 30), ("1.5gb", 3 << 29), ("4096", 4096),
                                        ("2 GiB", 2 << 30), (1024, 1024)])
def test_sizes_are_parsed(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "2 GBs", "-1", "mb", "1.2.3"])
def test_a_bad_size_is_a_clear_error(text):
    with pytest.raises(ValueError, match="500MB"):
        parse_size(text)


@pytest.mark.parametrize("free, limit", [(10 << 30, (10 << 30) // 20), (100 << 30, 2 << 30), (1 << 20, 16 << 20)])
def test_the_default_size_is_a_fraction_of_the_free_disk_capped_at_2gb(tmp_path, monkeypatch, free, limit):
    from qvl import sizes
    from qvl.sizes import auto_size

    # A fixed free space: the disk's own changes between two readings (the cache's first write) made this test fail
    # whenever 5% of it was under the cap.
    asked = []
    monkeypatch.setattr(sizes.shutil, "disk_usage", lambda path: asked.append(path) or SimpleNamespace(free=free))
    assert auto_size(str(tmp_path / "not" / "yet" / "made")) == limit and asked == [str(tmp_path)]
    assert AnswerCache(str(tmp_path / "c")).size_limit == limit
