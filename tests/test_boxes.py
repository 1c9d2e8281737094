"""Grounding: the boxes and points in an answer are found however the model wrote them, drawn on the image the
question was about under the answer in the chat (never sent back to the model), and returned by `ask` as data."""
import asyncio

import gradio as gr
import pytest
from gradio_client import Client, handle_file
from PIL import Image

from qvl import settings
from qvl.conversation import Stats
from qvl.serve import answers, boxes, cache, chat_tab, ui
from qvl.serve.boxes import PALETTE, Mark
from qvl.serve.ui import ASSETS
from test_documents import pdf
from test_openai_api import serving
from test_video import clip

SHAPES = str(ASSETS / "shapes.png")  # 640x480, red circles among blue squares
CIRCLES = [{"bbox_2d": [100, 125, 250, 375], "label": "red circle"},  # 64, 60, 160, 180 in its pixels
           {"bbox_2d": [400, 50, 550, 300], "label": "red circle"}]
FENCED = '```json\n[\n  {"bbox_2d": [100, 125, 250, 375], "label": "red circle"},\n' \
         '  {"bbox_2d": [400, 50, 550, 300], "label": "red circle"}\n]\n```'


def box(x1, y1, x2, y2, label="red circle") -> Mark:
    return Mark(label, "bbox_2d", (x1, y1, x2, y2))


# Finding them: whatever the model wrote, what parses is kept and the rest stays text.


@pytest.mark.parametrize("text", [
    "Here they are:\n" + FENCED + "\nTwo circles.",
    '[{"bbox_2d": [100, 125, 250, 375], "label": "red circle"}, {"bbox_2d": [400, 50, 550, 300], "label": '
    '"red circle"}]',
    'One {"bbox_2d": [100, 125, 250, 375], "label": "red circle"} and another {"label": "red circle", '
    '"bbox_2d": [400, 50, 550, 300]}.',
    '{"objects": [{"bbox_2d": [100, 125, 250, 375], "label": "red circle"}, '
    '{"bbox_2d": [400, 50, 550, 300], "label": "red circle"}]}',
], ids=["fenced", "bare list", "objects in prose", "nested"])
def test_boxes_are_found_fenced_bare_in_prose_or_nested(text):
    assert boxes.parse(text) == [box(100, 125, 250, 375), box(400, 50, 550, 300)]


def test_a_single_object_and_a_point():
    assert boxes.parse('{"bbox_2d": [1, 2, 3, 4], "label": "cat"}') == [box(1, 2, 3, 4, "cat")]
    assert boxes.parse('```json\n{"point_2d": [500, 250], "label": "nose"}\n```') == [
        Mark("nose", "point_2d", (500, 250))]


def test_a_list_cut_off_by_the_token_limit_keeps_its_complete_objects():
    cut = '```json\n[\n  {"bbox_2d": [10, 20, 30, 40], "label": "a"},\n  {"point_2d": [50, 60], "label": "b"},\n' \
          '  {"bbox_2d": [70, 80, 9'
    assert boxes.parse(cut) == [box(10, 20, 30, 40, "a"), Mark("b", "point_2d", (50, 60))]


@pytest.mark.parametrize("text", [
    "", "No boxes here.", "{not json}", "[1, 2, 3]", '{"label": "cat"}', '{"bbox_2d": "10, 20, 30, 40"}',
    '{"bbox_2d": [1, 2, 3]}', '{"point_2d": [1, 2, 3]}', '{"bbox_2d": [1, 2, "three", 4]}',
    '{"bbox_2d": [NaN, 2, 3, 4]}', '{"bbox_2d": [1, 2, Infinity, 4]}', '{"bbox_2d": [true, 2, 3, 4]}',
    '{"bbox_2d": [null, 2, 3, 4]}', '{"bbox_2d": [[1, 2, 3, 4]]}', "[" * 5000, "{" * 5000, "[" * 3000 + "]" * 3000,
])
def test_garbage_finds_nothing(text):
    assert boxes.parse(text) == []


def test_numbers_beyond_0_to_1000_cut_a_box_to_the_image_and_drop_what_is_off_it():
    found = boxes.parse('[{"bbox_2d": [-50, 100, 1200, 300]}, {"bbox_2d": [1100, 0, 1200, 100]},'
                        ' {"bbox_2d": [100, 100, 100, 200]}, {"point_2d": [1001, 5]}, {"point_2d": [-1, 5]},'
                        ' {"point_2d": [1000, 0]}]')
    assert found == [box(0, 100, 1000, 300, ""), Mark("", "point_2d", (1000, 0))]  # the empty box is dropped too


def test_corners_in_either_order_numbers_as_strings_and_any_label():
    found = boxes.parse('[{"bbox_2d": [300, 400, 100, 200], "label": 7}, {"bbox_2d": ["10", "20.5", "30", "40"]},'
                        ' {"point_2d": ["5", 6], "label": " a\\n  dog "}]')
    assert found == [box(100, 200, 300, 400, "7"), box(10, 20.5, 30, 40, ""), Mark("a dog", "point_2d", (5, 6))]


def test_thousandths_become_pixels_of_a_non_square_image_and_999_is_the_edge_as_1000_is():
    assert boxes.pixels(box(100, 125, 250, 375), (640, 480)) == (64, 60, 160, 180)
    assert boxes.pixels(box(0, 0, 999, 1000), (640, 480)) == (0, 0, 640, 480)
    assert boxes.pixels(box(0, 0, 1000, 999), (640, 480)) == (0, 0, 640, 480)
    assert boxes.pixels(Mark("", "point_2d", (500, 500)), (640, 480)) == (320, 240)
    assert boxes.described([box(100, 125, 250, 375)], (640, 480)) == [
        {"label": "red circle", "bbox_2d": [100, 125, 250, 375], "pixels": [64, 60, 160, 180]}]


# Drawing them: in the label's colour, where they are, on light and dark images alike.


@pytest.mark.parametrize("background", ["white", "black"])
def test_a_box_is_outlined_in_its_labels_colour_with_its_label_on_that_colour(background):
    image = Image.new("RGB", (640, 480), background)
    drawn = boxes.draw(image, [box(100, 125, 250, 375)])  # 64, 60, 160, 180
    colour = PALETTE[0]
    for edge in [(64, 120), (65, 120), (159, 120), (110, 60), (110, 179)]:  # left, right, top, bottom, 2 px thick
        assert drawn.getpixel(edge) == colour, edge
    assert drawn.getpixel((110, 120)) == image.getpixel((0, 0))  # inside: the picture itself
    assert drawn.getpixel((64, 59)) == colour  # just above the corner: the label's patch
    assert image.getpixel((64, 120)) != colour  # the picture given is left as it was


def test_each_label_has_its_own_colour_and_a_box_without_a_label_has_no_patch():
    image = Image.new("RGB", (640, 480), "white")
    marks = [box(100, 125, 250, 375, "cat"), box(500, 500, 700, 700, "dog"), box(800, 500, 900, 700, "cat"),
             box(100, 800, 200, 900, "")]
    drawn = boxes.draw(image, marks)
    assert drawn.getpixel((64, 120)) == PALETTE[0]  # cat
    assert drawn.getpixel((320, 300)) == PALETTE[1]  # dog
    assert drawn.getpixel((512, 300)) == PALETTE[0]  # cat again
    assert drawn.getpixel((64, 400)) == PALETTE[2] and drawn.getpixel((64, 383)) == (255, 255, 255)


def test_a_box_over_the_whole_image_shows_at_its_edges():
    drawn = boxes.draw(Image.new("RGB", (640, 480), "black"), [box(0, 0, 1000, 999, "")])
    assert drawn.getpixel((0, 240)) == drawn.getpixel((639, 240)) == drawn.getpixel((320, 479)) == PALETTE[0]


@pytest.mark.parametrize("background", ["white", "black"])
def test_a_point_is_a_dot_at_its_pixel(background):
    drawn = boxes.draw(Image.new("RGB", (640, 480), background), [Mark("nose", "point_2d", (250, 500))])
    assert drawn.getpixel((160, 240)) == PALETTE[0]
    assert drawn.getpixel((150, 240)) == Image.new("RGB", (1, 1), background).getpixel((0, 0))  # a dot, not a blot
    assert drawn.getpixel((169, 240)) == PALETTE[0]  # its label on the right, on its colour


# Which image: the one the question was about.


def test_the_marks_go_on_the_last_image_of_the_latest_turn_with_images(tmp_path):
    first, second, third = (tmp_path / f"{n}.png" for n in ("first", "second", "third"))
    for path, size in ((first, (10, 10)), (second, (20, 10)), (third, (30, 10))):
        Image.new("RGB", size).save(path)
    conversation = [{"role": "user", "text": "", "images": [str(first), str(second)]},
                    {"role": "assistant", "text": "Two.", "images": []},
                    {"role": "user", "text": "And these?", "images": [str(third)], "failed": True},
                    {"role": "assistant", "text": "", "images": [], "failed": True},
                    {"role": "user", "text": "Where is it?", "images": []}]
    image, marks = boxes.grounded(conversation, FENCED)
    assert image.size == (20, 10) and len(marks) == 2  # the failed turn's image never reached the model
    assert boxes.grounded(conversation, "Nowhere.") == (None, [])
    assert boxes.grounded(conversation[-1:], FENCED) == (None, [])  # no image to draw on
    second.unlink()  # swept after --upload-hours
    assert boxes.grounded(conversation, FENCED) == (None, [])


def test_a_pdfs_marks_go_on_its_last_page_and_a_videos_are_left_as_text(tmp_path):
    red, blue = (Image.new("RGB", (200, 280), colour) for colour in ("red", "blue"))
    two = pdf(tmp_path / "two.pdf", red, blue)
    image, marks = boxes.grounded([{"role": "user", "text": "Where?", "images": [two]}], FENCED)
    # The last page, as the model saw it: rendered at 200 DPI (the PDF holds it as a JPEG: blue, give or take).
    r, g, b = image.getpixel((133, 187))
    assert image.size == (267, 374) and b > 240 and r + g < 10 and len(marks) == 2
    red.save(tmp_path / "moving.gif", save_all=True, append_images=[blue], duration=500)
    for video in (clip(tmp_path / "clip.mp4"), str(tmp_path / "moving.gif")):  # marks on frames, named by time
        assert boxes.grounded([{"role": "user", "text": "Where?", "images": [video]}], FENCED) == (None, [])


# In the app: the chat shows them under the answer, the model never sees them, `ask` returns them.


def answering(monkeypatch, engine, text: str) -> list:
    """The engine answers `text` to everything; returns the turns it is sent, one list per question."""
    sent = []

    def chat(turns, params=None):
        sent.append(list(turns))
        yield text
        yield Stats(prompt_tokens=1, image_tokens=0, new_tokens=1, ttft_s=0.1, decode_tok_s=1.0, total_s=0.1,
                    stopped=False)

    monkeypatch.setattr(engine, "chat", chat)
    return sent


def respond(demo: gr.Blocks, conversation: list, config) -> tuple[list, list]:
    """The chat tab's answer to the pending question, driven as Gradio drives it; its last (conversation, shown)."""
    fn = next(f.fn for f in demo.fns.values() if f.name == "respond")
    request = gr.Request(headers={"accept-language": "en-US"}, session_hash="boxes")
    values = [getattr(config.gen, name) for name in settings.SESSION_PARAMS]

    async def last():
        async for update in fn(request, chat_tab.render(conversation), conversation, False, *values):
            final = update
        return final

    return asyncio.run(last())


def page(engine, tmp_path):
    """The page around `engine`, built in this process, and its settings."""
    config = settings.parse(["--cache-dir", str(tmp_path / "answers")], env={})
    return ui.build(answers.Answerer(engine, cache.AnswerCache(config.cache_dir), config), config), config


def test_the_chat_shows_the_drawn_picture_under_the_answer_and_never_sends_it_to_the_model(engine, monkeypatch,
                                                                                          tmp_path):
    sent = answering(monkeypatch, engine, "Found them:\n" + FENCED)
    demo, config = page(engine, tmp_path)
    asked = [{"role": "user", "text": "Outline every red circle.", "images": [SHAPES], "pending": True}]
    conversation, shown = respond(demo, asked, config)

    answer, picture = shown[-1]["content"]
    assert answer.startswith("Found them:\n```json") and "<sub>first token" in answer  # the stats stay with the text
    assert picture == conversation[-1]["drawn"]
    assert picture["alt_text"] == "The answer's boxes and points, drawn on the image"
    assert picture["path"].startswith(gr.Chatbot().GRADIO_CACHE)  # Gradio's own folder, which it serves
    drawn = Image.open(picture["path"])
    assert drawn.size == (640, 480) and drawn.convert("RGB").getpixel((64, 120)) == PALETTE[0]

    asked = conversation + [{"role": "user", "text": "And the squares?", "images": [], "pending": True}]
    conversation, shown = respond(demo, asked, config)
    assert [(turn.role, turn.images) for turn in sent[-1]] == [("user", (SHAPES,)), ("assistant", ()), ("user", ())]


def test_an_answer_without_marks_is_text_alone(engine, monkeypatch, tmp_path):
    answering(monkeypatch, engine, "Four red circles.")
    demo, config = page(engine, tmp_path)
    asked = [{"role": "user", "text": "How many?", "images": [SHAPES], "pending": True}]
    conversation, shown = respond(demo, asked, config)
    assert isinstance(shown[-1]["content"], str) and not conversation[-1].get("drawn")


def test_ask_returns_the_text_and_the_marks_as_data(engine, monkeypatch, tmp_path):
    engine.ready.set()
    answering(monkeypatch, engine, "Found them:\n" + FENCED)
    with serving(engine, tmp_path) as url:
        client = Client(url, verbose=False)
        answer, status, found = client.predict([handle_file(SHAPES)], "Outline every red circle.", use_cache=False,
                                               api_name="/ask")
        assert answer == "Found them:\n" + FENCED and "first token" in status
        assert found == [{**CIRCLES[0], "pixels": [64, 60, 160, 180]}, {**CIRCLES[1], "pixels": [256, 24, 352, 144]}]
        answering(monkeypatch, engine, "Four.")
        assert client.predict([], "How many?", use_cache=False, api_name="/ask")[2] == []
