"""Grounding: the boxes and points Qwen3-VL writes into an answer, found in its text and drawn on the image.

Asked to locate, detect or point at things, Qwen3-VL answers with JSON such as [{"bbox_2d": [x1, y1, x2, y2],
"label": "cat"}] or {"point_2d": [x, y], "label": "cat"}, often in a ```json fence, sometimes cut off by the token
limit. Its numbers are thousandths of the image's width and height (0-1000; Qwen2.5-VL wrote pixels), and since some
of Qwen's docs count 0-999, 999 is the far edge as well as 1000. The image they refer to is the conversation's last
(grounded()). PIL (and PDFium for a PDF's page): the page and the API use it without torch.
"""
import json
import math
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from qvl import documents, images
from qvl.conversation import InputError

SIZES = {"bbox_2d": 4, "point_2d": 2}  # each kind of mark, by the key the model writes, and how many numbers it has
# Saturated and of middle lightness, so an outline shows on white and on black; blue first, as it stands out on the
# red circles of the shapes example.
PALETTE = ((0, 114, 206), (245, 121, 0), (0, 158, 73), (214, 0, 170), (230, 30, 50), (0, 150, 160),
           (120, 80, 220), (140, 120, 0))
LONGEST_LABEL = 40  # characters written on the picture; the answer's text has the whole label
OPENING = re.compile(r"[\[{]")


@dataclass(frozen=True)
class Mark:
    """A box (x1, y1, x2, y2, with x1 < x2 and y1 < y2) or a point (x, y), in thousandths of the image's sides."""

    label: str
    kind: str  # "bbox_2d" or "point_2d", as the model names it
    at: tuple


def parse(text: str) -> list[Mark]:
    """Every box and point in an answer, in order: found in each JSON list or object of the text that parses, fenced
    or bare, nested or not; of a list cut off by the token limit, its complete objects. Anything else is text only.

    The rule for numbers: a number or a numeric string ("120"); a box's corners may come in either order; a box
    reaching beyond 0-1000 is cut to it and dropped if nothing is left; a point beyond it is dropped.
    """
    marks, decoder, start = [], json.JSONDecoder(), 0
    while found := OPENING.search(text, start):
        try:
            value, start = decoder.raw_decode(text, found.start())
        except (ValueError, RecursionError):  # not JSON, cut off, or nested too deep: try from the next bracket
            start = found.start() + 1
            continue
        pending = [value]  # walked without recursion, however deep the model nested it
        while pending:
            item = pending.pop()
            mark = marked(item) if isinstance(item, dict) else None
            if mark:
                marks.append(mark)
            elif isinstance(item, (list, dict)):
                pending.extend(reversed(list(item.values() if isinstance(item, dict) else item)))
    return marks


def marked(item: dict) -> Mark | None:
    """The object's mark by parse's rule, or None."""
    kind = next((kind for kind in SIZES if kind in item), None)
    numbers = item.get(kind)
    if not isinstance(numbers, list) or len(numbers) != SIZES[kind]:
        return None
    at = [number(n) for n in numbers]
    if None in at:
        return None
    label = item.get("label")
    label = "" if label is None else " ".join(str(label).split())
    if kind == "point_2d":
        return Mark(label, kind, tuple(at)) if all(0 <= n <= 1000 for n in at) else None
    x1, x2 = sorted(min(max(n, 0), 1000) for n in at[0::2])
    y1, y2 = sorted(min(max(n, 0), 1000) for n in at[1::2])
    return Mark(label, kind, (x1, y1, x2, y2)) if x1 < x2 and y1 < y2 else None


def number(value) -> int | float | None:
    """A coordinate: a finite JSON number or numeric string, as an int where it is whole; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        value = float(value)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return int(value) if value.is_integer() else value


def pixels(mark: Mark, size: tuple[int, int]) -> tuple[int, ...]:
    """The mark in pixels of an image of `size` (width, height): v thousandths of a side are round(v * side / 1000),
    and 999 is the whole side too."""
    sides = size * (len(mark.at) // 2)
    return tuple(side if v >= 999 else round(v * side / 1000) for v, side in zip(mark.at, sides))


def grounded(conversation: list[dict], text: str) -> tuple[Image.Image | None, list[Mark]]:
    """An answer's marks and the image they refer to, decoded as the model saw it: the last image of the latest user
    turn that has any (a failed turn never reached the model), which for a PDF is its last page. (None, []) when the
    answer has no marks, the conversation no image, the image is gone since (--upload-hours), or the last upload is
    a video (an animated GIF too), whose marks are on frames that the answer names by time."""
    marks = parse(text)
    source = next((e["images"][-1] for e in reversed(conversation)
                   if e["role"] == "user" and e["images"] and not e.get("failed")), None)
    if not marks or source is None:
        return None, []
    try:
        kind = images.sniff(source)[0]
        if kind == "video":
            return None, []
        # The PDF was within --max-pdf-pages when it was asked about, or its turn failed.
        last = documents.pages(source, "", math.inf)[-1] if kind == "pdf" else source
        return images.load(last), marks
    except InputError:
        return None, []


def described(marks: list[Mark], size: tuple[int, int]) -> list[dict]:
    """The marks as data: label, the model's own numbers under its key, and the same in pixels of the image."""
    return [{"label": mark.label, mark.kind: list(mark.at), "pixels": list(pixels(mark, size))} for mark in marks]


def draw(image: Image.Image, marks: list[Mark]) -> Image.Image:
    """A copy of `image` with the marks in their label's colour (one per label, in order of appearance): boxes
    outlined, points as dots ringed in white, each label beside its mark on a patch of its colour, so that it reads
    on light and dark images alike."""
    image = image.convert("RGB")  # a copy, whatever the mode
    width, height = image.size
    pen, line = ImageDraw.Draw(image), max(2, round(max(width, height) / 300))
    font, pad, dot = ImageFont.load_default(size=max(12, round(max(width, height) / 40))), line, 3 * line
    colours = {}
    for mark in marks:
        colours.setdefault(mark.label, PALETTE[len(colours) % len(PALETTE)])
    placed = [(mark, pixels(mark, image.size)) for mark in marks]
    for mark, at in placed:
        if mark.kind == "bbox_2d":  # PIL's corners are inclusive, and its outline is drawn inside them
            x1, y1, x2, y2 = at
            pen.rectangle((x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)), outline=colours[mark.label], width=line)
        else:
            x, y = min(at[0], width - 1), min(at[1], height - 1)
            pen.ellipse((x - dot, y - dot, x + dot, y + dot), fill=colours[mark.label], outline="white",
                        width=max(1, line // 2))
    for mark, at in placed:  # the labels after every outline, so that none crosses one
        if not mark.label:
            continue
        text = mark.label[:LONGEST_LABEL]
        left, top, right, bottom = font.getbbox(text)
        w, h = right - left + 2 * pad, bottom - top + 2 * pad
        if mark.kind == "bbox_2d":  # above the box's corner, or inside it at the top edge of the image
            x, y = at[0], at[1] - h if at[1] >= h else at[1]
        else:  # right of the dot
            x, y = at[0] + dot + line, at[1] - h // 2
        x, y = max(0, min(x, width - w)), max(0, min(y, height - h))
        colour = colours[mark.label]
        pen.rectangle((x, y, x + w - 1, y + h - 1), fill=colour)
        ink = "black" if 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2] > 150 else "white"
        pen.text((x + pad - left, y + pad - top), text, fill=ink, font=font)
    return image
