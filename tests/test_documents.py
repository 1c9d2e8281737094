"""PDF uploads: each page an image of the same turn, in order, through the same image budget; a clear refusal for a
PDF that is broken or too long."""
from dataclasses import replace

import pytest
from PIL import Image, ImageChops, ImageDraw, ImageStat

from qvl import images, settings
from qvl.conversation import InputError, Turn

PARAMS = settings.GenParams(greedy=True, max_new_tokens=4)


def receipt() -> Image.Image:
    """A receipt as a phone would scan it (larger than the image budget): dark print on off-white, a column of
    prices and a total."""
    image = Image.new("RGB", (720, 1200), (246, 244, 238))
    draw = ImageDraw.Draw(image)
    for i, (item, price) in enumerate([("COFFEE", "3.20"), ("BAGEL", "2.75"), ("JUICE", "4.10"), ("TOTAL", "10.05")]):
        draw.text((60, 120 + 80 * i), item, fill=(20, 20, 20), font_size=40)
        draw.text((520, 120 + 80 * i), price, fill=(20, 20, 20), font_size=40)
    draw.line((60, 430, 660, 430), fill=(20, 20, 20), width=4)
    return image


def pdf(path, *pages: Image.Image):
    """A PDF of the pages as a scanner writes one: each page an image at 150 DPI."""
    pages[0].save(path, "PDF", save_all=True, append_images=list(pages[1:]), resolution=150)
    return str(path)


def test_a_receipt_in_a_pdf_reaches_the_model_as_the_same_receipt_as_a_png(tmp_path, engine):
    png = tmp_path / "receipt.png"
    receipt().save(png)
    (from_png,), (from_pdf,) = [images.opened([Turn("user", "Total?", (source,))], PARAMS)[0].images
                                for source in (str(png), pdf(tmp_path / "receipt.pdf", receipt()))]
    budget = (PARAMS.max_image_tokens, PARAMS.min_image_tokens)
    a, b = images.prepare(from_png.image, *budget), images.prepare(from_pdf.image, *budget)
    assert a.size == b.size
    # The PDF holds the scan as JPEG and is rendered at 200 DPI, then scaled to the budget: near, not equal.
    assert max(ImageStat.Stat(ImageChops.difference(a, b)).mean) < 3
    png_stats, pdf_stats = [list(engine.chat([Turn("user", "What is the total?", (source,))], PARAMS))[-1]
                            for source in (str(png), str(tmp_path / "receipt.pdf"))]
    assert pdf_stats.image_tokens == png_stats.image_tokens > 0


def test_the_pages_of_a_pdf_are_the_images_of_its_turn_in_order(tmp_path):
    colours = [(200, 0, 0), (0, 160, 0), (0, 0, 220)]
    path = pdf(tmp_path / "three.pdf", *[Image.new("RGB", (200, 280), c) for c in colours])
    turn, = images.opened([Turn("user", "Compare the pages.", (Image.new("RGB", (64, 64)), path))],
                          PARAMS)
    assert len(turn.images) == 4 and all(isinstance(p, images.Picture) for p in turn.images)
    centres = [p.image.getpixel((p.image.width // 2, p.image.height // 2)) for p in turn.images[1:]]
    assert [max(range(3), key=c.__getitem__) for c in centres] == [0, 1, 2]


def test_a_pdf_past_the_page_limit_is_refused_in_both_languages(tmp_path, engine):
    path = pdf(tmp_path / "long.pdf", *[Image.new("RGB", (100, 140), "white")] * 3)
    with pytest.raises(InputError) as refused:
        images.opened([Turn("user", "Summarize.", (path,))], replace(PARAMS, max_pdf_pages=2))
    assert refused.value.key == "pdf_too_many_pages"
    assert "long.pdf has 3 pages" in refused.value.say("en") and "2" in refused.value.say("en")
    assert "3 页" in refused.value.say("zh-CN")
    with pytest.raises(InputError, match="3 pages"):  # the engine refuses it before any model compute
        list(engine.chat([Turn("user", "Summarize.", (path,))], replace(PARAMS, max_pdf_pages=2)))
    assert len(images.opened([Turn("user", "Summarize.", (path,))], replace(PARAMS, max_pdf_pages=3))[0].images) == 3


@pytest.mark.parametrize("content", [b"", b"%PDF-1.7\n garbage", b"\x89PNG not really a pdf at all"])
def test_garbage_named_pdf_is_refused_as_a_broken_pdf(tmp_path, content):
    path = tmp_path / "scan.pdf"
    path.write_bytes(content)
    with pytest.raises(InputError) as refused:
        images.opened([Turn("user", "Read it.", (str(path),))], PARAMS)
    assert refused.value.key == "pdf_damaged" and "scan.pdf" in refused.value.say("en")
    assert "scan.pdf" in refused.value.say("zh-CN")


def test_a_pdf_sent_as_bytes_is_recognised_by_its_content(tmp_path):
    data = open(pdf(tmp_path / "a.pdf", receipt()), "rb").read()
    turn, = images.opened([Turn("user", "Total?", (data,))], PARAMS)
    assert len(turn.images) == 1 and abs(turn.images[0].image.width - receipt().width * 200 / 150) <= 1  # 200 DPI
