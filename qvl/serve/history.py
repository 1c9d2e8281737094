"""Conversations kept in the browser: a chat turned into a record and back, and its downloads.

A record is {"id", "title", "turns"}, each turn {"role", "text", "images"} with the images as data URLs, plus the
"note", "empty" and "failed" the chat showed, a Thinking model's "reasoning" with its section's "thought" (title,
status, duration), and "drawn": true for an answer whose boxes were drawn, which are drawn again when it is
reopened (chat_tab.reopened) rather than kept as a picture: JSON through and through, so it lives in the browser's
localStorage (gr.BrowserState) and the server keeps none of it. A browser gives a site about 5 MB there, and Gradio
stores the value encrypted, a third larger; so qvl keeps at most KEPT_COUNT conversations in KEPT_BYTES of JSON, the
oldest dropped first. Each image is kept as a JPEG at most IMAGE_SIDE pixels wide and high, and a conversation keeps
IMAGES_BYTES of them: an image past that is left out, and its question says so, as it does for an upload that is no
picture (a PDF, a video).
"""
import base64
import binascii
import functools
import hashlib
import io
import json
import re
import zipfile
from pathlib import Path

from qvl import images, texts
from qvl.conversation import InputError

IMAGE_SIDE = 1024  # px: room for OCR's 1024 image tokens; the model reads what --max-image-tokens allows of it
IMAGES_BYTES = 1 << 20  # a kept conversation's images, as data URLs
KEPT_BYTES = 2 << 20  # every kept conversation together, as JSON
KEPT_COUNT = 50
TITLE_CHARS = 48
FORMAT = "qvl-conversation/1"  # what a downloaded JSON says it is
KEPT_KEYS = ("note", "empty", "failed", "reasoning", "thought")  # what the chat showed beside a turn's text
DATA_URL = re.compile(r"data:image/(png|jpeg|webp|gif);base64,([A-Za-z0-9+/]*={0,2})")


@functools.lru_cache(maxsize=16)
def data_url(path: str) -> str:
    """A picture as it is kept: its own bytes if it is a JPEG within IMAGE_SIDE already (one kept before), else
    downscaled to it. Raises InputError for a file that is gone or no picture. The last few are cached (at most
    about 1.4 MB each), since each answer keeps its whole conversation again."""
    image, data = images.load(path), Path(path).read_bytes()
    if max(image.size) > IMAGE_SIDE or not data.startswith(b"\xff\xd8\xff"):
        image.thumbnail((IMAGE_SIDE, IMAGE_SIDE))
        out = io.BytesIO()
        image.save(out, "JPEG", quality=85)
        data = out.getvalue()
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def record(conversation: list[dict], id: str, lang: str) -> dict:
    """The chat's entries as a record to keep, its images within IMAGES_BYTES; an answer's drawn boxes are marked
    to be drawn again only if the picture they are on (boxes.grounded's: the last of the latest question with
    pictures) is kept."""
    turns, budget, grounded_kept = [], IMAGES_BYTES, False
    for entry in conversation:
        urls, left_out = [], 0
        for path in entry["images"]:
            try:  # a video (an animated GIF too) is not kept as its first frame: reopened, it would be a still
                url = data_url(path) if images.sniff(path)[0] == "image" else ""
            except InputError:  # gone from the server, or never a picture (its question was refused)
                url = ""
            kept = bool(url) and len(url) <= budget
            if kept:
                urls.append(url)
                budget -= len(url)
            else:
                left_out += 1
        if entry["role"] == "user" and entry["images"] and not entry.get("failed"):
            grounded_kept = kept  # its last picture's
        text = entry["text"]
        if left_out:
            text = " ".join(filter(None, (text, texts.say(lang, "not_kept", count=left_out,
                                                          limit=f"{IMAGES_BYTES >> 20} MB"))))
        turns.append({"role": entry["role"], "text": text, "images": urls,
                      **{key: entry[key] for key in KEPT_KEYS if entry.get(key)},
                      **({"drawn": True} if entry.get("drawn") and grounded_kept else {})})
    return {"id": id, "title": title(turns, lang), "turns": turns}


def title(turns: list[dict], lang: str) -> str:
    """A conversation's name in the list: the first line of its first question."""
    first = next((t["text"].strip() for t in turns if t["role"] == "user" and t["text"].strip()), "")
    line = first.splitlines()[0] if first else texts.say(lang, "untitled")
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1] + "…"


def keep(store: list[dict], kept: dict) -> list[dict]:
    """The browser's conversations with `kept` first, in place of its older copy, then as many of the others, newest
    first, as KEPT_COUNT and KEPT_BYTES allow."""
    result, size = [kept], len(json.dumps(kept))
    for other in store:
        if other["id"] == kept["id"]:
            continue
        size += len(json.dumps(other))
        if size > KEPT_BYTES or len(result) == KEPT_COUNT:
            break
        result.append(other)
    return result


def restore(kept: dict, folder: str) -> list[dict]:
    """The chat's entries from a record, each image written back to a file in `folder` (Gradio's uploads), where
    the model reads it."""
    return [{"role": turn["role"], "text": turn["text"], "images": [written(folder, *decoded(url)) for url in
                                                                    turn["images"]],
             **{key: turn[key] for key in (*KEPT_KEYS, "drawn") if key in turn}} for turn in kept["turns"]]


def decoded(url: str) -> tuple[bytes, str]:
    """A kept image's bytes and a file name for them."""
    kind, data = DATA_URL.fullmatch(url).groups()
    return base64.b64decode(data), f"image.{'jpg' if kind == 'jpeg' else kind}"


def written(folder: str, data: bytes, name: str) -> str:
    """data as the file `name` in `folder`, under a name of its content: Gradio serves it from there and deletes it
    after --upload-hours, as it does uploads (written again if there, so that its time starts anew)."""
    path = Path(folder) / hashlib.sha256(data).hexdigest()[:32] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def file_name(kept: dict, extension: str) -> str:
    """A download's name, after the conversation's title."""
    stem = re.sub(r"\W+", "-", kept["title"]).strip("-")[:40]
    return f"{stem or 'conversation'}.{extension}"


def to_json(kept: dict) -> bytes:
    return json.dumps({"format": FORMAT, "title": kept["title"], "turns": kept["turns"]}, ensure_ascii=False,
                      indent=1).encode()


def from_json(data: bytes, id: str) -> dict:
    """The record a downloaded JSON holds, given `id`; InputError("not_a_conversation") for anything else, or one
    larger than a kept conversation may be."""
    try:
        value = json.loads(data) if len(data) <= KEPT_BYTES else None
    except ValueError:  # not JSON, or not UTF-8
        value = None
    if not (isinstance(value, dict) and value.get("format") == FORMAT and isinstance(value.get("title"), str)
            and isinstance(value.get("turns"), list) and value["turns"] and all(map(_is_turn, value["turns"]))
            and sum(len(url) for turn in value["turns"] for url in turn["images"]) <= IMAGES_BYTES):
        raise InputError("not_a_conversation")
    return {"id": id, "title": value["title"], "turns": value["turns"]}


def _is_turn(turn) -> bool:
    return (isinstance(turn, dict) and turn.keys() <= {"role", "text", "images", "drawn", *KEPT_KEYS}
            and turn.get("role") in ("user", "assistant") and isinstance(turn.get("text"), str)
            and isinstance(turn.get("images"), list) and all(map(_is_image, turn["images"]))
            and all(isinstance(turn.get(key, ""), str) for key in ("note", "empty", "reasoning"))
            and all(isinstance(turn.get(key, False), bool) for key in ("failed", "drawn"))
            and _is_thought(turn.get("thought", {})))


def _is_thought(thought) -> bool:
    """A reasoning section's Chatbot metadata as answers.thought makes it."""
    return (isinstance(thought, dict) and thought.keys() <= {"title", "status", "duration"}
            and isinstance(thought.get("title", ""), str) and thought.get("status", "done") in ("done", "pending")
            and type(thought.get("duration", 0)) in (int, float))


def _is_image(url) -> bool:
    try:
        return isinstance(url, str) and DATA_URL.fullmatch(url) is not None and bool(decoded(url)[0])
    except binascii.Error:
        return False


def to_zip(kept: dict, lang: str) -> bytes:
    """conversation.md with its pictures in images/: a zip, since Markdown viewers show a picture file beside it
    where many refuse (or bury the text under) the same picture inline as a data URI."""
    out, lines, count = io.BytesIO(), [f"# {kept['title']}", ""], 0
    with zipfile.ZipFile(out, "w") as archive:
        for turn in kept["turns"]:
            lines += [f"**{texts.say(lang, 'md_' + turn['role'])}**", ""]
            for url in turn["images"]:
                count += 1
                data, name = decoded(url)
                path = f"images/{count}{Path(name).suffix}"
                archive.writestr(zipfile.ZipInfo(path), data)  # ZipInfo's fixed date: a record gives the same bytes
                lines += [f"![{count}]({path})", ""]
            if turn.get("reasoning"):  # collapsed, as the chat shows it
                title = turn.get("thought", {}).get("title") or texts.say(lang, "thinking")
                lines += [f"<details><summary>{title}</summary>", "", turn["reasoning"], "", "</details>", ""]
            lines += [part for part in (turn["text"], turn.get("empty")) if part] + [""]
            if turn.get("note"):
                lines += [f"<sub>{turn['note']}</sub>", ""]
        archive.writestr(zipfile.ZipInfo("conversation.md"), "\n".join(lines), zipfile.ZIP_DEFLATED)
    return out.getvalue()
