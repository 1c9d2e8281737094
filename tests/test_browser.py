"""The page in a real headless Chromium (Debian's, driven by Playwright): what a user clicks, sees and waits for."""
import os
import threading
import time
from pathlib import Path

import pytest

from qvl import settings
from qvl.engine import modelcache, modes
from qvl.engine.local import Engine
from qvl.serve.ui import ASSETS
from test_boxes import answering
from test_documents import pdf, receipt
from test_openai_api import serving
from test_remote import ended
from test_robustness import watch
from test_video import clip

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
def app(launch_app):
    # Answers far longer than the test waits, so that Stop always has something to stop; one thread, so that the
    # browser has a core of its own on a two-core machine.
    with launch_app("--min-new-tokens", "3000", "--max-new-tokens", "3000", "--threads", "1") as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(autouse=True)
def pages_closed(browser):
    """Each test's pages close when it ends: a page left open keeps polling its server, or reconnecting once it is
    gone, and on two cores a module's worth of them starved the later tests' pages until they timed out."""
    yield
    for context in browser.contexts:
        context.close()


def open_page(browser, app, locale="en-US", width=1280):
    page = browser.new_page(viewport={"width": width, "height": 1000 if width > 640 else 844}, locale=locale)
    page.set_default_timeout(30_000)
    page.goto(app.url)
    page.wait_for_selector("#chatbot")
    return page


def answer(page) -> str:
    return page.locator('#chatbot [data-testid="bot"]').last.inner_text()


def send(page, question: str):
    page.locator("#ask textarea").fill(question)
    page.locator("#ask textarea").press("Enter")


def wait_for_growing_answer(page) -> str:
    """Wait until the last answer has text and then more text: it is streaming. Watched in the page at every frame,
    from the first text of the answer that is last then (a new answer starts over), so that text arriving between two
    of the test's round trips to the browser still counts as growth."""
    page.evaluate("() => { window.qvlWatched = -1; }")
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chatbot [data-testid=bot]');
        const length = bots.length ? bots[bots.length - 1].innerText.length : 0;
        if (window.qvlWatched !== bots.length) { window.qvlWatched = bots.length; window.qvlFirst = 0; }
        window.qvlFirst = window.qvlFirst || length;
        return window.qvlFirst > 0 && length > window.qvlFirst;
    }""")
    return answer(page)


def shoot(page, name: str, **options):
    """A screenshot in artifacts/; with QVL_UPDATE_SCREENSHOTS=1 also the README's copy in assets/."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / name, **options)
    if os.environ.get("QVL_UPDATE_SCREENSHOTS") == "1":
        page.screenshot(path=ASSETS / name, **options)


def shoot_chat(page, name: str):
    """A screenshot of the chat alone, for the README's row of what the model can do: on a taller page, so that a
    question with its picture and the answer with its own fit in it."""
    page.set_viewport_size({"width": page.viewport_size["width"], "height": 1500})
    page.wait_for_function("() => document.querySelector('#chatbot').getBoundingClientRect().height >= 0.64 * 1500")
    shoot(page, name, clip=page.locator("#chatbot").bounding_box())


def upload(page, path):
    page.locator("#ask input[type=file]").set_input_files(str(path))
    page.wait_for_selector('#ask img, #ask [data-testid="thumbnail"], #ask .thumbnail-item', state="attached")


def answered(page) -> str:
    """The last answer once it has its stats line."""
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')].pop()?.innerText"
                           ".includes('total')")
    return answer(page)


def stop(page):
    page.locator("#ask button.stop-button").click()
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')].pop()"
                           "?.innerText.trim().endsWith('stopped')")
    page.wait_for_selector("#ask button.submit-button")  # send is back in place of stop


def test_upload_ask_stream_stop_and_change_threads(browser, app):
    page = open_page(browser, app)
    page.locator("#ask input[type=file]").set_input_files(str(ASSETS / "chart.png"))
    page.wait_for_selector('#ask img, #ask [data-testid="thumbnail"]', state="attached")
    send(page, "What does this chart show?")
    shown = page.wait_for_selector('#chatbot [data-testid="user"] img')  # the image is in the history...
    assert shown.bounding_box()["height"] <= 10 * 16 + 1  # ...as a thumbnail, not 400 px tall
    shown.click()  # which opens full size
    full = page.wait_for_selector("#qvl-full img")
    assert full.bounding_box()["height"] > shown.bounding_box()["height"]
    page.keyboard.press("Escape")
    page.wait_for_selector("#qvl-full", state="detached")
    wait_for_growing_answer(page)
    assert page.locator("#ask textarea").is_disabled()  # no second question while one is answered
    assert page.locator("#ask button.stop-button").is_visible()  # send turned into stop
    assert page.locator("#ask button.submit-button").count() == 0

    stop(page)
    stopped = answer(page)
    time.sleep(1)
    assert answer(page) == stopped  # nothing more arrives
    assert page.locator("#ask textarea").is_enabled()

    # The worker is free again: the next question starts streaming (it would wait ~a minute otherwise).
    send(page, "And the smallest bar?")
    page.wait_for_function("() => document.querySelectorAll('#chatbot [data-testid=bot]').length == 2")
    wait_for_growing_answer(page)
    stop(page)
    shoot(page, "screenshot-chat.png")

    page.get_by_role("tab", name="Settings").click()
    page.locator("#server").get_by_text("This server", exact=True).click()  # collapsed until asked for
    page.wait_for_selector("#facts >> text=1 intra-op")
    assert page.locator("#operator-only").is_hidden()  # bound to localhost: whoever is here runs the server
    threads = page.locator('#threads input[data-testid="number-input"]')
    threads.fill("2")
    threads.press("Enter")
    page.wait_for_selector("#facts >> text=2 intra-op")
    assert page.locator("#facts >> text=Answer cache folder").count() == 1
    assert page.locator("#cache-status >> text=Answer cache: on").count() == 1
    assert page.locator("#cache-status >> text=Conversation memory: on").count() == 1
    assert "hits" in page.locator("#cache-status").inner_text().split("Conversation memory:")[1]
    shoot(page, "screenshot-settings.png", full_page=True)


def test_an_empty_answer_says_so_above_its_stats_line(browser, engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--greedy", "--max-new-tokens", "4") as url:  # greedy: only blank lines
        page = open_page(browser, type("App", (), {"url": url}))
        send(page, "Say nothing?")
        page.wait_for_function("() => document.querySelector('#chatbot [data-testid=bot]')?.innerText"
                               ".includes('total')")
        said = [line for line in answer(page).splitlines() if line.strip()]
        assert said[0] == "(the model gave no answer: rephrase the question, or press Retry for another try)"
        assert said[1].startswith("first token") and len(said) == 2
        assert "no answer" not in page.locator("#chatbot [data-testid=bot] sub").inner_text()  # not small print


def test_a_phone_offers_the_api_link_too(browser, app):
    page = open_page(browser, app, width=390)
    link = page.locator("footer").get_by_role("button", name="Use via API")
    assert link.is_visible()
    box = link.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390  # on the screen, not pushed off its side


def test_a_second_app_in_front_of_the_first_streams_and_stop_ends_the_answer_on_both(browser, engine, launch_app,
                                                                                    tmp_path, monkeypatch):
    # The first (--backend's) in this process, so its engine is watched; the second asks it for 3000 tokens, and
    # it never answers in fewer, so only Stop ends the answer early.
    engine.ready.set()
    runs = watch(monkeypatch, engine)
    with serving(engine, tmp_path, "--min-new-tokens", "3000", "--max-new-tokens", "3000") as first, \
            launch_app("--backend", first + "v1", "--max-new-tokens", "3000") as second:
        page = open_page(browser, second)
        send(page, "Tell me a long story.")
        wait_for_growing_answer(page)
        stop(page)
        stopped = answer(page)
        time.sleep(1)
        assert answer(page) == stopped  # nothing more arrives
        assert page.locator("#ask textarea").is_enabled()
        assert ended(runs)["pieces"] < 3000  # the first's generation ended too


def test_the_empty_chat_offers_examples_and_enter_on_an_empty_box_sends_nothing(browser, app):
    page = open_page(browser, app)
    page.wait_for_selector("#warming", state="hidden")  # the banner goes once the engine has warmed up
    page.wait_for_selector("#chatbot >> text=Ask anything about a picture")
    examples = page.locator("#chatbot .example")
    assert examples.count() == 4 and all(examples.nth(i).locator("img").count() == 1 for i in range(4))
    page.locator("#ask textarea").press("Enter")
    time.sleep(1)
    assert page.locator('#chatbot [data-testid="user"], #chatbot [data-testid="bot"]').count() == 0

    examples.filter(has_text="Outline every red circle").click()
    page.wait_for_selector('#chatbot [data-testid="user"] img')
    assert "Outline every red circle and label it" in page.locator('#chatbot [data-testid="user"]').last.inner_text()
    wait_for_growing_answer(page)
    stop(page)


def test_regenerate_undo_and_clear_are_the_chats_own_quiet_actions(browser, app):
    page = open_page(browser, app)
    send(page, "First try?")
    first = wait_for_growing_answer(page)
    assert page.locator("#chatbot button[aria-label=Retry]").is_disabled()  # not while answering
    assert page.locator("#chatbot button[aria-label=Undo]").is_disabled()
    stop(page)
    assert page.locator("#chatbot [data-testid=status-tracker]", has_text="Error").count() == 0
    page.locator("#chatbot button[aria-label=Retry]").click()  # a fresh sample of the same question
    # The new sample's own text: neither the stopped one still shown nor the line it waits in behind that one's step.
    page.wait_for_function("t => { const b = [...document.querySelectorAll('#chatbot [data-testid=bot]')];"
                           " const s = b[0]?.innerText.trim() ?? ''; return b.length == 1 && s.length > 0"
                           " && !t.startsWith(s) && !s.startsWith('Waiting in line') && !s.endsWith('stopped') }",
                           arg=first)
    stop(page)
    assert page.locator('#chatbot [data-testid="user"]').count() == 1
    page.locator("#chatbot button[aria-label=Undo]").click()  # the question goes back into the box
    page.wait_for_function("() => document.querySelector('#ask textarea').value == 'First try?'")
    assert page.locator('#chatbot [data-testid="user"]').count() == 0
    send(page, "Second try?")
    wait_for_growing_answer(page)
    page.locator("#chatbot button[aria-label=Clear]").click()  # while answering: it ends the answer too
    page.wait_for_selector("#chatbot >> text=Ask anything about a picture")
    page.wait_for_selector("#ask button.submit-button")
    time.sleep(1)
    assert page.locator('#chatbot [data-testid="bot"]').count() == 0  # nothing more arrives
    assert page.locator("#chatbot [data-testid=status-tracker]", has_text="Error").count() == 0


def test_the_page_speaks_the_browsers_language(browser, app, tmp_path):
    page = open_page(browser, app, locale="zh-CN", width=390)
    page.wait_for_selector("#chatbot >> text=关于图片，尽管问")
    assert page.locator("#chatbot .example").first.inner_text().strip().startswith("哪种水果卖得最多")
    shoot(page, "screenshot-phone.png")
    notes = tmp_path / "notes.png"
    notes.write_text("Shopping list: milk, bread")
    page.locator("#ask input[type=file]").set_input_files(str(notes))
    page.wait_for_selector('#ask [data-testid="thumbnail"], #ask img, #ask .thumbnail-item', state="attached")
    send(page, "这是什么？")
    page.wait_for_selector("#chatbot >> text=无法读取 notes.png，它不是本应用能识别的图片")
    page.get_by_role("tab", name="设置").click()
    page.locator("#server").get_by_text("本服务器", exact=True).click()
    page.wait_for_selector("#facts >> text=算子内")


def test_the_operator_of_a_quantized_model_reads_its_settings_in_their_language(browser, engine, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(engine, "precision", modes.describe("w8a14"))  # what the log and the cache key name
    engine.ready.set()
    with serving(engine, tmp_path) as url:
        page = open_page(browser, type("App", (), {"url": url}), locale="zh-CN")
        page.get_by_role("tab", name="设置").click()
        page.locator("#server").get_by_text("本服务器", exact=True).click()
        page.wait_for_selector("#facts >> text=w8a14：同 int8")
        assert "fbgemm int8 linears" not in page.locator("#facts").inner_text()
        assert page.locator("#cache-status >> text=回答缓存：开启").count() == 1


def test_a_visitor_sees_server_settings_read_only_and_an_admin_can_change_them(browser, launch_app):
    with launch_app("--host", "0.0.0.0", "--auth", "guest:guest-pw,boss:boss-pw", "--admins", "boss",
                    "--max-new-tokens", "4") as app:
        login = browser.new_page(viewport={"width": 1280, "height": 800})
        login.goto(app.url)
        login.wait_for_selector("text=Chat about images with Qwen3-VL, answered by this server's CPU")
        shoot(login, "login.png")
        for user, operator in (("guest", False), ("boss", True)):
            context = browser.new_context(http_credentials=None, viewport={"width": 1280, "height": 1000})
            page = context.new_page()
            page.set_default_timeout(30_000)
            page.goto(app.url)
            page.locator("input[type=text]").first.fill(user)
            page.locator("input[type=password]").fill(f"{user}-pw")
            page.locator("input[type=password]").press("Enter")
            page.wait_for_selector("#chatbot")
            page.get_by_role("tab", name="Settings").click()
            page.locator("#server").get_by_text("This server", exact=True).click()
            page.wait_for_selector("#facts >> text=intra-op")
            slider = page.locator('#threads input[data-testid="number-input"]')
            assert slider.is_enabled() == operator and page.locator("#clear-cache").is_enabled() == operator
            assert page.locator("#operator-only").is_visible() != operator
            assert (page.locator("#facts >> text=Answer cache folder").count() == 1) == operator
            assert ("/tmp/" in page.locator("#facts").inner_text()) == operator  # the model's and cache's paths
            if operator:
                page.locator("#clear-cache").click()
                page.locator("#clear-yes").click()  # asked first: it deletes every visitor's cached answers
                page.wait_for_selector("#confirm-clear", state="hidden")
            context.close()


def ask_and_wait(page, question: str, answers: int):
    send(page, question)
    page.wait_for_function("n => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
                           ".filter(b => b.innerText.includes('total')).length == n", arg=answers)


def test_a_conversation_the_server_forgot_says_so_and_starts_over(browser, launch_app):
    with launch_app("--max-sessions", "1", "--max-new-tokens", "4") as app:
        page = open_page(browser, app)
        ask_and_wait(page, "First question?", 1)
        other = open_page(browser, app)
        ask_and_wait(other, "Another visitor's question?", 1)  # the one session kept is theirs
        other.locator("#kept-list label", has_text="Another visitor's question?").wait_for(state="attached")
        send(page, "Second question?")  # once their last step, which reads their conversation, is done
        page.wait_for_selector("#chatbot >> text=no longer remembers the earlier messages")
        assert "total" in answered(page)
        users = page.locator('#chatbot [data-testid="user"]').all_inner_texts()
        assert [u.strip() for u in users] == ["Second question?"]


def test_a_conversation_forgotten_between_its_question_and_its_answer_says_to_ask_again(browser, launch_app):
    with launch_app("--max-sessions", "1", "--max-new-tokens", "4") as app:
        page, other = open_page(browser, app), open_page(browser, app)
        held = []  # the answer step's request, held until the other visitor has taken the one session kept
        page.route("**/queue/join*", lambda route: held.append(route))
        send(page, "A question?")
        page.wait_for_selector('#chatbot [data-testid="user"]')
        page.wait_for_timeout(300)
        assert len(held) == 1
        ask_and_wait(other, "Another visitor's question?", 1)
        held[0].continue_()
        page.unroute("**/queue/join*")
        page.wait_for_selector("#chatbot >> text=forgot this conversation before it could answer")
        page.wait_for_function("() => !document.querySelector('#ask textarea').disabled")
        assert page.locator('#chatbot [data-testid="user"]').count() == 0
        ask_and_wait(page, "A question?", 1)  # asked again, it is answered


def test_a_conversation_is_kept_in_the_browser_through_a_reload_and_its_json_brings_it_back(browser, engine,
                                                                                          tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--max-new-tokens", "4") as url:
        page = open_page(browser, type("App", (), {"url": url}))
        page.locator("#ask input[type=file]").set_input_files(str(ASSETS / "chart.png"))
        page.wait_for_selector('#ask img, #ask [data-testid="thumbnail"]', state="attached")
        ask_and_wait(page, "Which fruit sold the most?", 1)
        page.locator("#kept button.toggle-button").click()
        listed = page.locator("#kept-list label")
        listed.filter(has_text="Which fruit sold the most?").wait_for()  # kept once answered
        page.reload()
        page.locator("#kept button.toggle-button").click()
        listed.filter(has_text="Which fruit sold the most?").click()
        page.wait_for_selector('#chatbot [data-testid="user"] img')  # its picture, kept in the browser
        assert "Which fruit sold the most?" in page.locator('#chatbot [data-testid="user"]').last.inner_text()
        assert "total" in answer(page)
        with page.expect_download() as saved:
            page.locator("#kept-json").click()
        assert saved.value.suggested_filename == "Which-fruit-sold-the-most.json"
        saved.value.save_as(tmp_path / saved.value.suggested_filename)
        (tmp_path / "notes.json").write_text('{"note": "not a conversation"}')
        for upload in (tmp_path / "notes.json", tmp_path / saved.value.suggested_filename):
            with page.expect_file_chooser() as chooser:
                page.locator("#kept-upload").click()
            chooser.value.set_files(str(upload))
            if upload.name == "notes.json":  # refused, and the chat and the list are as they were
                page.wait_for_selector("text=This file is not a conversation downloaded from this app as JSON")
                assert listed.count() == 1 and page.locator('#chatbot [data-testid="user"] img').count() == 1
                page.locator("#kept-new").click()
                page.wait_for_selector("#chatbot >> text=Ask anything about a picture")
        page.wait_for_selector('#chatbot [data-testid="user"] img')  # the uploaded one, shown
        assert listed.all_inner_texts() == ["Which fruit sold the most?"] * 2


def test_an_edited_question_is_answered_again_reusing_the_turns_before_it(browser, engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--max-new-tokens", "4") as url:
        page = open_page(browser, type("App", (), {"url": url}))
        for n, question in enumerate(("First question?", "Second question?", "Third question?"), 1):
            ask_and_wait(page, question, n)
        page.locator('#chatbot [data-testid="user"]').nth(1).hover()
        page.locator('#chatbot button[aria-label="Edit"]').nth(1).click()
        page.locator("#chatbot textarea").fill("Second question, edited?")
        page.locator("#chatbot button[aria-label=Submit]").click()
        page.wait_for_function("() => { const b = [...document.querySelectorAll('#chatbot [data-testid=bot]')];"
                               " return b.length == 2 && b[1].innerText.includes('total') }")
        users = page.locator('#chatbot [data-testid="user"]').all_inner_texts()
        assert [u.strip() for u in users] == ["First question?", "Second question, edited?"]
        assert "prompt tokens reused" in answer(page)  # the first exchange, from conversation memory


def test_the_warming_banner_says_what_the_start_does_and_how_far_it_is(browser, tiny_dir, tmp_path, monkeypatch):
    release, real = threading.Event(), modelcache.load

    def load(*args, **kwargs):  # a first start, 42% through converting the checkpoint until released
        args[-1]("converting", 0.42)
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(modelcache, "load", load)
    engine = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache",
                                    "--cache-dir", str(tmp_path / "cache")], env={}), background=True)
    with serving(engine, tmp_path) as url:
        page = open_page(browser, type("App", (), {"url": url}), locale="zh-CN")
        page.wait_for_selector("#warming >> text=正在为此 CPU 转换模型，仅首次启动需要：42%")
        release.set()
        page.wait_for_selector("#warming >> text=正在预热：回答第一个问题……")
        engine.warm_up([], "Hi")
        page.wait_for_selector("#warming", state="hidden")


def test_a_fallback_after_the_page_is_up_raises_its_banner(browser, make_engine, tmp_path):
    # Weights that fail to load in the background fall back to the tiny model after the page was built.
    engine = make_engine()
    with serving(engine, tmp_path) as url:
        page = open_page(browser, type("App", (), {"url": url}))
        page.wait_for_selector("#warming", state="visible")
        assert not page.locator("#fallback").is_visible()
        engine.fallback = "could not load 'Qwen/Qwen3-VL-2B-Instruct': SafetensorError: incomplete metadata"
        page.wait_for_selector("#fallback", state="visible")
        engine.ready.set()
        page.wait_for_selector("#warming", state="hidden")


# The shapes example's four red circles as Qwen3-VL outlines them, in thousandths of the picture's sides (the tiny
# model cannot): what the README's screenshot draws.
CIRCLES = "```json\n[\n" + ",\n".join(f'  {{"bbox_2d": {box}, "label": "red circle"}}' for box in (
    [70, 115, 211, 302], [398, 73, 539, 260], [711, 219, 852, 406], [242, 594, 383, 781])) + "\n]\n```"


def test_boxes_in_an_answer_are_drawn_under_it_open_full_size_and_download(browser, engine, tmp_path, monkeypatch):
    engine.ready.set()
    answering(monkeypatch, engine, "Found them:\n" + CIRCLES)
    with serving(engine, tmp_path) as url:
        page = open_page(browser, type("App", (), {"url": url}), width=800)
        page.locator("#chatbot .example").filter(has_text="Outline every red circle").click()
        drawn = page.wait_for_selector('#chatbot [data-testid="bot"] img')  # under the answer's text
        assert "Found them:" in page.locator('#chatbot [data-testid="bot"]').first.inner_text()
        page.wait_for_function("picture => picture.complete && picture.naturalWidth > 0", arg=drawn)
        shoot_chat(page, "screenshot-boxes.png")
        page.locator('#chatbot a[download]').last.wait_for()  # Gradio's download button beside the picture
        assert page.locator('#chatbot a[download]').last.get_attribute("href").rsplit("/", 1)[1].startswith("boxes-")
        drawn.click()
        page.wait_for_selector("#qvl-full img")


# Answers of some length, short enough to end with their stats line (the tiny model may stream them whole between two
# of a test's looks: the tests of long answers watch streaming).
STREAMED = ("--min-new-tokens", "120", "--max-new-tokens", "120")


def test_a_video_is_answered_from_the_page_and_its_stats_line_says_what_it_cost(browser, engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, *STREAMED) as url:
        page = open_page(browser, type("App", (), {"url": url}), width=800)
        upload(page, clip(tmp_path / "squares.webm", size=(320, 180)))
        send(page, "What happens in this clip?")
        page.wait_for_selector('#chatbot [data-testid="user"] video')  # shown as a video, to play
        # 3 s at 10 fps, sampled at 2 a second: 6 frames, 3 pairs of 320x192 (the budget's multiples of 32), 60
        # tokens each.
        assert "video: 6 frames, 180 tokens" in answered(page)
        shoot_chat(page, "screenshot-video.png")


def test_a_pdf_is_answered_from_the_page_as_the_images_of_its_pages(browser, engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, *STREAMED) as url:
        page = open_page(browser, type("App", (), {"url": url}))
        # Three scanned receipts of 720x1200 px at 150 DPI: each rendered at 200 DPI (961x1600) and scaled to the
        # default budget of 320 tokens (416x736, 299 tokens).
        upload(page, pdf(tmp_path / "receipts.pdf", *[receipt()] * 3))
        send(page, "What is the total on each page?")
        assert "· 897 image tokens ·" in answered(page)


def test_a_thinking_models_reasoning_is_a_collapsed_section_that_says_how_long_it_took(browser, thinking_dir,
                                                                                     tmp_path):
    engine = Engine(settings.parse(["--model", str(thinking_dir), "--quant", "fp32", "--no-cache",
                                    "--cache-dir", str(tmp_path / "cache")], env={}))
    engine.ready.set()
    # The tiny model's reasoning for this question with this seed ends before the token cap: an answer follows it.
    with serving(engine, tmp_path, "--max-new-tokens", "300", "--seed", "4") as url:
        page = open_page(browser, type("App", (), {"url": url}), width=800)
        upload(page, ASSETS / "chart.png")
        send(page, "What does this chart show?")
        answered(page)
        thought = page.locator("#chatbot .thought-group")
        assert thought.count() == 1 and "Thinking" in thought.inner_text()
        assert thought.locator(".duration").inner_text().strip().endswith("s)")  # how long it took
        assert thought.locator(".children").count() == 0  # collapsed: its title alone
        shoot_chat(page, "screenshot-thinking.png")
