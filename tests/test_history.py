"""A chat people can edit and keep: a kept conversation (qvl/serve/history.py) and back, its bounds and downloads, and
an edited question answered again after the turns before it."""
import io
import json
import random
import zipfile

import pytest
from PIL import Image

from qvl import images, texts
from qvl.conversation import InputError
from qvl.serve import answers, chat_tab, history
from qvl.serve.boxes import PALETTE
from test_boxes import FENCED, SHAPES
from test_documents import pdf
from test_engine import picture
from test_kv import ask
from test_video import clip


def noise(path, side: int) -> str:
    """A picture that JPEG cannot shrink: random pixels, the same each run."""
    Image.frombytes("RGB", (side, side), random.Random(side).randbytes(side * side * 3)).save(path)
    return str(path)


@pytest.fixture
def chat(tmp_path) -> list[dict]:
    """A chat as the chat tab holds it: a large photo and a question, an answer with its stats line, a follow-up."""
    picture(2000, 1500).save(tmp_path / "photo.png")
    return [{"role": "user", "text": "What is in this picture?\nBe brief.", "images": [str(tmp_path / "photo.png")]},
            {"role": "assistant", "text": "A red card with a **blue** square.", "images": [], "note": "4.2 s total"},
            {"role": "user", "text": "And its colour?", "images": []},
            {"role": "assistant", "text": "", "images": [], "empty": "(no answer)", "note": "0.1 s total"}]


def test_a_kept_conversation_comes_back_with_its_texts_roles_and_pictures(chat, tmp_path):
    kept = history.record(chat, "c1", "en")
    assert kept["id"] == "c1" and kept["title"] == "What is in this picture?"
    restored = history.restore(kept, str(tmp_path / "uploads"))
    assert [(e["role"], e["text"], e.get("note"), e.get("empty")) for e in restored] == \
        [(e["role"], e["text"], e.get("note"), e.get("empty")) for e in chat]
    [path] = restored[0]["images"]
    assert path.startswith(str(tmp_path / "uploads")) and images.load(path).size == (1024, 768)  # downscaled
    assert history.record(restored, "c1", "en") == kept  # kept again as it is, not compressed once more


def test_a_thinking_models_reasoning_is_kept_and_reopens_as_its_collapsed_section(chat, tmp_path):
    thought = {"title": "Thinking", "status": "done", "duration": 2.5}
    chat[1].update(reasoning="Three bars; the first is tallest.", thought=thought)
    kept = history.from_json(history.to_json(history.record(chat, "c1", "en")), "c1")  # downloaded and uploaded too
    reasoning, answer = chat_tab.render(chat_tab.reopened(kept, str(tmp_path / "uploads"), "en"))[1:3]
    assert reasoning == {"role": "assistant", "content": "Three bars; the first is tallest.", "metadata": thought}
    assert answer["content"].startswith("A red card")
    markdown = zipfile.ZipFile(io.BytesIO(history.to_zip(kept, "en"))).read("conversation.md").decode()
    assert ("**Assistant**\n\n<details><summary>Thinking</summary>\n\nThree bars; the first is tallest.\n\n</details>"
            "\n\nA red card") in markdown


def test_an_answers_boxes_are_drawn_again_when_it_reopens_if_their_picture_was_kept(tmp_path):
    answer = {"role": "assistant", "text": FENCED, "images": [], "drawn": {"path": "gone.png", "alt_text": "boxes"}}
    large = [noise(tmp_path / f"noise{i}.png", 900) for i in range(2)]  # the second over the bound: left out
    for pictures, drawn in (([SHAPES], True), (large, False)):
        chat = [{"role": "user", "text": "Outline the red circles.", "images": pictures}, answer]
        kept = history.record(chat, "c", "en")
        assert kept["turns"][1].get("drawn", False) is drawn and "gone.png" not in json.dumps(kept)
        shown = chat_tab.reopened(kept, str(tmp_path / "uploads"), "en")[1].get("drawn")
        if drawn:  # on the kept picture (the shapes' 640x480 as they were), in a file of its own
            redrawn = Image.open(shown["path"])
            assert redrawn.size == (640, 480) and redrawn.getpixel((64, 60)) == PALETTE[0]
        else:
            assert "drawn" not in kept["turns"][1] and shown is None


def test_a_downloaded_json_uploaded_again_is_the_same_conversation(chat):
    kept = history.record(chat, "c1", "en")
    again = history.from_json(history.to_json(kept), "c2")
    assert again == dict(kept, id="c2")
    assert "What is in this picture?" in history.to_json(kept).decode()  # readable, Chinese too


def valid() -> dict:
    return json.loads(history.to_json(history.record([{"role": "user", "text": "Hi", "images": []}], "c", "en")))


def changed(**fields) -> bytes:
    return json.dumps(dict(valid(), **fields)).encode()


def with_turn(**fields) -> bytes:
    return changed(turns=[dict(valid()["turns"][0], **fields)])


@pytest.mark.parametrize("data", [
    b"", b"not json", b"\xff\xfe\x00", b"[]", b'"a string"', changed(format="something else"), changed(turns=[]),
    changed(turns="Hi"), changed(title=None), with_turn(role="system"), with_turn(text=None), with_turn(images="x"),
    with_turn(images=["https://example.com/a.png"]), with_turn(images=["data:image/png;base64,@@@"]),
    with_turn(images=["data:image/png;base64,"]), with_turn(images=["data:image/png;base64,abc"]),
    with_turn(failed="yes"), with_turn(note=3), with_turn(secret="x"), with_turn(reasoning=["x"]),
    with_turn(drawn="yes"), with_turn(thought="Thinking"), with_turn(thought={"title": 3}),
    with_turn(thought={"status": "lost"}), with_turn(thought={"duration": "1 s"}), with_turn(thought={"log": "x"}),
    with_turn(images=["data:image/jpeg;base64," + "A" * (history.IMAGES_BYTES + 4)]),
    changed(padding="x" * history.KEPT_BYTES)], ids=lambda data: data[:40].decode(errors="replace"))
def test_anything_but_a_downloaded_conversation_is_refused_in_both_languages(data):
    with pytest.raises(InputError) as refused:
        history.from_json(data, "c")
    assert refused.value.say("en").startswith("This file is not a conversation downloaded from this app")
    assert refused.value.say("zh-CN").startswith("此文件不是从本应用下载的 JSON 对话")


def test_a_conversation_keeps_its_pictures_up_to_its_bound_and_says_which_it_left_out(tmp_path):
    big = [noise(tmp_path / f"noise{i}.png", 900) for i in range(3)]  # each about 600 KB as a kept JPEG
    chat = [{"role": "user", "text": "Compare these.", "images": big[:2]},
            {"role": "user", "text": "", "images": [big[2], str(tmp_path / "gone.png")]}]
    kept = history.record(chat, "c", "en")
    assert [len(turn["images"]) for turn in kept["turns"]] == [1, 0]
    assert sum(len(url) for turn in kept["turns"] for url in turn["images"]) <= history.IMAGES_BYTES
    said = "file(s) not kept: a kept conversation holds pictures only, 1 MB of them]"
    assert [turn["text"] for turn in kept["turns"]] == [f"Compare these. [1 {said}", f"[2 {said}"]
    zh = history.record(chat, "c", "zh-CN")["turns"][1]["text"]
    assert zh == "[2 个文件未保存：每段保存的对话只保存图片，最多 1 MB]"


def test_a_pdf_or_a_video_is_not_kept_and_its_question_says_so(tmp_path):
    still = noise(tmp_path / "still.png", 64)
    moving = [Image.new("RGB", (64, 64), colour) for colour in ("red", "blue")]
    moving[0].save(tmp_path / "moving.gif", save_all=True, append_images=moving[1:], duration=500)
    uploads = [pdf(tmp_path / "pages.pdf", *moving), clip(tmp_path / "clip.mp4"), str(tmp_path / "moving.gif")]
    kept = history.record([{"role": "user", "text": "Compare.", "images": [*uploads, still]}], "c", "en")
    # The animated GIF is a video to the model: not kept as its first frame, which would reopen as a still.
    assert len(kept["turns"][0]["images"]) == 1 and "[3 file(s) not kept" in kept["turns"][0]["text"]


def test_the_browser_keeps_the_newest_conversations_within_the_bounds():
    def conversation(id, size=0):
        return {"id": id, "title": id, "turns": [{"role": "user", "text": "x" * size, "images": []}]}

    store = []
    for i in range(history.KEPT_COUNT + 5):
        store = history.keep(store, conversation(f"c{i}"))
    assert [kept["id"] for kept in store] == [f"c{i}" for i in reversed(range(5, history.KEPT_COUNT + 5))]
    store = history.keep(store, conversation("c7", 10))  # kept again: first, in place of its older copy
    assert [kept["id"] for kept in store[:3]] == ["c7", f"c{history.KEPT_COUNT + 4}", f"c{history.KEPT_COUNT + 3}"]
    assert len(store) == history.KEPT_COUNT and store[0]["turns"][0]["text"] == "x" * 10
    store = history.keep(store, conversation("big", history.KEPT_BYTES // 2))
    store = history.keep(store, conversation("bigger", history.KEPT_BYTES // 2))
    assert [kept["id"] for kept in store] == ["bigger"]  # the older ones dropped first, the new one never
    assert len(json.dumps(history.keep(store, conversation("small")))) <= history.KEPT_BYTES


def test_the_markdown_download_is_a_zip_of_the_conversation_and_its_pictures(chat):
    kept = history.record(chat, "c1", "en")
    data = history.to_zip(kept, "en")
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.namelist() == ["images/1.jpg", "conversation.md"]
    assert Image.open(archive.open("images/1.jpg")).size == (1024, 768)
    assert archive.read("conversation.md").decode() == (
        "# What is in this picture?\n\n**You**\n\n![1](images/1.jpg)\n\nWhat is in this picture?\nBe brief.\n\n"
        "**Assistant**\n\nA red card with a **blue** square.\n\n<sub>4.2 s total</sub>\n\n"
        "**You**\n\nAnd its colour?\n\n**Assistant**\n\n(no answer)\n\n<sub>0.1 s total</sub>\n")
    assert history.to_zip(kept, "en") == data  # the same conversation, the same file
    assert "**你**" in zipfile.ZipFile(io.BytesIO(history.to_zip(kept, "zh-CN"))).read("conversation.md").decode()


@pytest.mark.parametrize("text, lang, title", [
    ("A short question", "en", "A short question"), ("  \n", "en", "Pictures without a question"),
    ("Why " * 20, "en", ("Why " * 12)[:47] + "…"), ("", "zh-CN", "没有提问的图片")])
def test_a_conversation_is_named_by_its_first_question(text, lang, title):
    turns = [{"role": "assistant", "text": "Hello", "images": []}, {"role": "user", "text": text, "images": []}]
    assert history.title(turns, lang) == title


def test_download_names_keep_letters_of_any_script():
    assert history.file_name({"title": "What is this? A/B"}, "zip") == "What-is-this-A-B.zip"
    assert history.file_name({"title": "这是什么？"}, "json") == "这是什么.json"
    assert history.file_name({"title": "？！"}, "json") == "conversation.json"


@pytest.mark.parametrize("lang", texts.LANGUAGES)
def test_the_sidebar_states_the_bounds_the_browser_keeps(lang):
    said = texts.TEXT[lang]["kept_here"]
    for bound in (f"{history.KEPT_COUNT}", f"{history.KEPT_BYTES >> 20} MB", f"{history.IMAGE_SIDE}",
                  f"{history.IMAGES_BYTES >> 20} MB"):
        assert bound in said


def test_an_edited_question_is_answered_after_the_turns_before_it_whose_memory_is_reused(make_engine, tmp_path):
    engine = make_engine()
    picture().save(tmp_path / "card.png")
    chat, first = [], None
    for question in ("What is in this picture?", "What colour is it?", "How big is it?"):
        chat.append({"role": "user", "text": question, "images": [] if chat else [str(tmp_path / "card.png")]})
        answer = ask(engine, answers.turns(chat))
        chat.append({"role": "assistant", "text": answer.text, "images": [], "note": "stats"})
        first = first or answer.text

    asked = chat_tab.edited(chat, 2, "Where is it?")
    assert [(e["role"], e["text"]) for e in asked] == [("user", "What is in this picture?"), ("assistant", first),
                                                       ("user", "Where is it?")]
    assert asked[-1]["pending"] and chat[2]["text"] == "What colour is it?"  # the chat itself is left as it was
    again = ask(engine, answers.turns(asked))
    alone = ask(engine, answers.turns(asked[-1:]))
    # The first exchange (with its picture) is all the prompt has beyond the edited question: reused, not computed.
    assert again.stats.reused_tokens >= again.stats.prompt_tokens - alone.stats.prompt_tokens > 0
    assert chat_tab.edited(chat, 0, "")[0]["images"] == chat[0]["images"]  # a picture is still something to ask
    assert chat_tab.edited(chat, 2, "  ") is None  # an emptied question is nothing to ask
