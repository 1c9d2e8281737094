"""Bad and awkward input at the engine: each upload or question is answered, or refused before any compute with a
message that names the file and says what to do, and the engine answers the next request as usual."""
import io
import struct
import zlib
from dataclasses import replace

import pytest
from PIL import Image, ImageDraw

from qvl import images, texts
from qvl.conversation import Stats, Turn
from qvl.engine import generate
from qvl.images import MAX_SOURCE_PIXELS, InputError
from qvl.settings import GenParams

SHORT = GenParams(greedy=True, max_new_tokens=4, min_new_tokens=4)
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def answer(engine, turns, params=SHORT) -> tuple[str, Stats]:
    *pieces, stats = engine.chat(turns, params)
    return "".join(pieces), stats


def refusal(engine, monkeypatch, turns, params=SHORT) -> str:
    """The InputError message for turns, raised with generation forbidden; then checks the engine still answers."""

    def no_generation(*args, **kwargs):
        raise AssertionError("generation started for a request that should have been refused")

    with monkeypatch.context() as m:
        m.setattr(generate, "stream", no_generation)
        with pytest.raises(InputError) as refused:
            next(engine.chat(turns, params))
    _, stats = answer(engine, [Turn("user", "And this one?", (scene(),))])
    assert stats.new_tokens == SHORT.max_new_tokens
    return str(refused.value)


def scene(w=64, h=32) -> Image.Image:
    """Red top-left, green top-right, blue bottom half: any rotation or mirroring moves a colour."""
    image = Image.new("RGB", (w, h), BLUE)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, w // 2 - 1, h // 2 - 1), RED)
    draw.rectangle((w // 2, 0, w - 1, h // 2 - 1), GREEN)
    return image


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def upload(tmp_path, name: str, data: bytes) -> str:
    """A file as Gradio hands it to the app: a path whose name is the user's file name."""
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def close_to(pixel, colour, tolerance=60) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, colour))


def assert_scene(image: Image.Image):
    w, h = image.size
    assert (w, h) == (64, 32)
    assert close_to(image.getpixel((w // 4, h // 4)), RED)
    assert close_to(image.getpixel((3 * w // 4, h // 4)), GREEN)
    assert close_to(image.getpixel((w // 2, 3 * h // 4)), BLUE)


def bomb_png(w: int, h: int) -> bytes:
    """A 1-bit black PNG of w x h whose data really inflates to w*h/8 bytes, written without allocating it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    deflate, row = zlib.compressobj(9), b"\0" * (1 + (w + 7) // 8)  # filter byte + packed bits
    data = b"".join(deflate.compress(row) for _ in range(h)) + deflate.flush()
    header = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


MINIMAL_PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
    b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 612 792]>>endobj\ntrailer<</Root 1 0 R>>\n%%EOF\n"
)


def cut(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


UNREADABLE = {
    "notes.png": (lambda: b"Shopping list:\n- milk\n- bread\n", "notes.png is not a picture"),
    "scan.pdf": (lambda: cut(MINIMAL_PDF), "scan.pdf is not a PDF this app can read"),  # a whole one is answered
    "empty.jpg": (lambda: b"", "empty.jpg is empty"),
    "cut.jpg": (lambda: cut(encoded(Image.effect_noise((96, 64), 60).convert("RGB"), "JPEG")), "cut.jpg is damaged"),
    "cut.png": (lambda: cut(encoded(Image.effect_noise((96, 64), 60).convert("RGB"), "PNG")), "cut.png is damaged"),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_an_unreadable_upload_is_refused_by_name_before_compute(engine, monkeypatch, tmp_path, name):
    make, expected = UNREADABLE[name]
    message = refusal(engine, monkeypatch, [Turn("user", "What is this?", (upload(tmp_path, name, make()),))])
    assert message.startswith(expected)
    assert "please upload" in message


@pytest.mark.parametrize("key", ["not_image", "empty_file"])
@pytest.mark.parametrize("lang", texts.LANGUAGES)
def test_a_file_refused_for_its_type_is_told_every_kind_of_upload_the_app_takes(key, lang):
    said = InputError(key, name="notes.txt").say(lang)
    assert all(kind in said for kind in ("PNG", "GIF", "MP4", "WebM", "MOV", "PDF")), said


@pytest.mark.parametrize("size", [(30000, 30000), (9000, 9000)])  # over Pillow's own limit; over only ours
def test_a_decompression_bomb_is_refused_without_decoding_it(engine, monkeypatch, tmp_path, size):
    data = bomb_png(*size)
    assert len(data) < 120_000 and size[0] * size[1] > MAX_SOURCE_PIXELS
    path = upload(tmp_path, "huge.png", data)
    with monkeypatch.context() as m:
        m.setattr("PIL.ImageFile.ImageFile.load", lambda self: pytest.fail("the bomb's pixels were decoded"))
        message = refusal(engine, monkeypatch, [Turn("user", "What is this?", (path,))])
    assert message.startswith("huge.png has") and "up to 64 megapixels" in message and "downscale" in message


@pytest.mark.parametrize("size", [(1, 1), (10000, 20), (20, 10000)])
def test_tiny_and_extreme_aspect_images_are_answered_within_the_token_budget(engine, tmp_path, size):
    path = upload(tmp_path, "odd.png", encoded(Image.new("RGB", size, RED), "PNG"))
    _, stats = answer(engine, [Turn("user", "What colour is it?", (path,))])
    assert stats.new_tokens == SHORT.max_new_tokens
    assert SHORT.min_image_tokens <= stats.image_tokens <= SHORT.max_image_tokens


def cmyk_jpeg() -> bytes:
    cmyk = {RED: (0, 255, 255, 0), GREEN: (255, 0, 255, 0), BLUE: (255, 255, 0, 0)}
    image = scene()
    out = Image.new("CMYK", image.size)
    out.putdata([cmyk[p] for p in image.getdata()])
    return encoded(out, "JPEG", quality=95)


def palette_with_alpha_png() -> bytes:
    """A palette PNG whose bottom half is transparent: it must come out white, not black or blue."""
    image = scene().quantize(colors=4)
    blue = image.getpixel((32, 24))
    return encoded(image, "PNG", transparency=blue)


def animated_gif() -> bytes:
    frames = [scene(), Image.new("RGB", (64, 32), (255, 255, 0)), Image.new("RGB", (64, 32), (0, 255, 255))]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def grey16(fmt: str, mode: str) -> bytes:
    """16-bit greyscale: white left half (65535), mid-grey right half (32768)."""
    image = Image.new(mode, (64, 32), 32768)
    image.paste(65535, (0, 0, 32, 32))
    return encoded(image, fmt)


def test_cmyk_jpeg_keeps_its_colours(engine, tmp_path):
    assert_loads_as_the_scene(engine, upload(tmp_path, "print.jpg", cmyk_jpeg()))


def test_palette_png_with_transparency_is_composited_on_white(engine, tmp_path):
    image = images.load(upload(tmp_path, "logo.png", palette_with_alpha_png()))
    assert close_to(image.getpixel((16, 8)), RED) and close_to(image.getpixel((48, 8)), GREEN)
    assert image.getpixel((32, 24)) == (255, 255, 255)
    _, stats = answer(engine, [Turn("user", "Describe the logo.", (image,))])
    assert stats.new_tokens == SHORT.max_new_tokens


def test_animated_gif_answers_about_its_first_frame(engine, tmp_path):
    assert_loads_as_the_scene(engine, upload(tmp_path, "dance.gif", animated_gif()))


@pytest.mark.parametrize("fmt, mode", [("PNG", "I;16"), ("TIFF", "I;16B"), ("TIFF", "I;16")])
def test_16_bit_greyscale_is_scaled_to_8_bits_not_clipped(engine, tmp_path, fmt, mode):
    path = upload(tmp_path, f"xray.{fmt.lower()}", grey16(fmt, mode))
    image = images.load(path)
    assert image.mode == "RGB"
    assert image.getpixel((8, 8)) == (255, 255, 255) and image.getpixel((56, 8)) == (128, 128, 128)
    _, stats = answer(engine, [Turn("user", "What is shown?", (path,))])
    assert stats.new_tokens == SHORT.max_new_tokens


# EXIF orientation: how a camera stores a photo taken at that angle; the viewer must undo it.
STORED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


@pytest.mark.parametrize("orientation", sorted(STORED))
def test_exif_rotated_photo_is_shown_upright(engine, tmp_path, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = scene().transpose(STORED[orientation])
    assert_loads_as_the_scene(engine, upload(tmp_path, "phone.jpg", encoded(stored, "JPEG", quality=95, exif=exif)))


def assert_loads_as_the_scene(engine, path: str):
    assert_scene(images.load(path))
    _, stats = answer(engine, [Turn("user", "Describe it.", (path,))])
    assert stats.new_tokens == SHORT.max_new_tokens and stats.image_tokens > 0


@pytest.mark.parametrize("text", ["", "   ", "\n\t \u3000"])
def test_an_empty_message_without_an_image_is_refused(engine, monkeypatch, text):
    assert refusal(engine, monkeypatch, [Turn("user", text)]) == "Please type a question or add an image."


def test_an_image_without_a_question_is_answered(engine):
    _, stats = answer(engine, [Turn("user", "", (scene(),))])
    assert stats.new_tokens == SHORT.max_new_tokens


def test_a_200kb_question_is_refused_with_the_context_limit(engine, monkeypatch):
    question = "Please read this carefully. " * 7200  # ~200 KB, pasted by mistake
    assert len(question.encode()) > 200_000
    message = refusal(engine, monkeypatch, [Turn("user", question)])
    assert f"but this model handles at most {engine.max_context}." in message and "Clear the conversation" in message
    assert "image" not in message.split(".")[0]  # no "(0 for 0 images)" when there are none


def test_more_images_than_the_context_holds_are_refused_naming_the_image_count(engine, monkeypatch):
    budget = replace(SHORT, max_image_tokens=1024, min_image_tokens=1024)
    count = engine.max_context // 1024 + 1
    pictures = tuple(scene(1024, 1024) for _ in range(count))
    message = refusal(engine, monkeypatch, [Turn("user", "Compare them.", pictures)], budget)
    assert f"({count * 1024} of them for {count} images)" in message and "fewer or smaller images" in message


ODD_TEXT = {
    "rtl": "ما الذي في الصورة؟ ומה זה?",
    "bidi override": "abc\u202edcba\u202c",
    "emoji zwj": "Who is 👩‍👩‍👧‍👦 and 🏳️‍🌈?",
    "combining": "Ẓ̶̡a̸͕l̵g̷o̶ e\u0301\u0302\u0303",
    "zero width and bom": "\ufeffa\u200bb\u200dc",
    "control": "a\x00b\x07c\x1b[31m",
    "cjk": "这张图片里有什么？",
}


@pytest.mark.parametrize("kind", ODD_TEXT)
def test_odd_unicode_reaches_the_model_byte_for_byte(engine, kind):
    """The tiny tokenizer spends one token per UTF-8 byte, so nothing was dropped or mangled on the way."""
    text = ODD_TEXT[kind]
    _, plain = answer(engine, [Turn("user", "", (scene(),))])
    _, odd = answer(engine, [Turn("user", text, (scene(),))])
    assert odd.prompt_tokens - plain.prompt_tokens == len(text.encode("utf-8"))
    assert odd.new_tokens == SHORT.max_new_tokens


def test_surrogates_from_json_escapes_are_joined_or_replaced_not_an_error(engine):
    """json.loads('"\\ud83d\\ude00 \\ud800"') is a legal str with surrogates; the tokenizer cannot encode those."""
    _, pair = answer(engine, [Turn("user", "\ud83d\ude00")])
    _, emoji = answer(engine, [Turn("user", "😀")])
    assert pair.prompt_tokens == emoji.prompt_tokens
    _, lone = answer(engine, [Turn("user", "a\ud800b")])
    _, replaced = answer(engine, [Turn("user", "a\ufffdb")])
    assert lone.prompt_tokens == replaced.prompt_tokens and lone.new_tokens == SHORT.max_new_tokens
