"""The page in a real headless Chromium (Debian's, driven by Playwright): what a user clicks, sees and waits for."""
import time
from pathlib import Path

import pytest

from qvl.ui import ASSETS

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


def open_page(browser, app, locale="en-US"):
    page = browser.new_page(viewport={"width": 1280, "height": 1000}, locale=locale)
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
    """Wait until the last answer has text and then more text: it is streaming."""
    page.wait_for_function("() => document.querySelector('#chatbot [data-testid=bot]')?.innerText.length > 0")
    first = answer(page)
    page.wait_for_function(
        "n => [...document.querySelectorAll('#chatbot [data-testid=bot]')].pop().innerText.length > n", arg=len(first)
    )
    return answer(page)


def test_upload_ask_stream_stop_and_change_threads(browser, app):
    ARTIFACTS.mkdir(exist_ok=True)
    page = open_page(browser, app)
    page.locator("#ask input[type=file]").set_input_files(str(ASSETS / "chart.png"))
    page.wait_for_selector('#ask img, #ask [data-testid="thumbnail"]', state="attached")
    send(page, "What does this chart show?")
    page.wait_for_selector('#chatbot [data-testid="user"] img')  # the image is shown in the history
    wait_for_growing_answer(page)
    assert page.locator("#ask textarea").is_disabled()  # no second question while one is answered

    page.locator("#stop").click()
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')].pop()"
                           ".innerText.trim().endsWith('stopped')")
    stopped = answer(page)
    time.sleep(1)
    assert answer(page) == stopped  # nothing more arrives
    assert page.locator("#ask textarea").is_enabled()

    # The worker is free again: the next question starts streaming (it would wait ~a minute otherwise).
    send(page, "And the smallest bar?")
    page.wait_for_function("() => document.querySelectorAll('#chatbot [data-testid=bot]').length == 2")
    wait_for_growing_answer(page)
    page.locator("#stop").click()
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')].pop()"
                           ".innerText.trim().endsWith('stopped')")
    page.screenshot(path=ARTIFACTS / "chat.png", full_page=True)

    page.get_by_role("tab", name="Settings").click()
    page.wait_for_selector("#facts >> text=1 intra-op")
    threads = page.locator('#threads input[data-testid="number-input"]')
    threads.fill("2")
    threads.press("Enter")
    page.wait_for_selector("#facts >> text=2 intra-op")
    page.screenshot(path=ARTIFACTS / "settings.png", full_page=True)


def test_the_page_speaks_the_browsers_language(browser, app):
    page = open_page(browser, app, locale="zh-CN")
    assert page.locator("#stop").inner_text().strip() == "停止"
    page.get_by_role("tab", name="设置").click()
    page.wait_for_selector("#facts >> text=算子内")


def ask_and_wait(page, question: str, answers: int):
    send(page, question)
    page.wait_for_function("n => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
                           ".filter(b => b.innerText.includes('total')).length == n", arg=answers)


def test_a_conversation_the_server_forgot_says_so_and_starts_over(browser, launch_app):
    with launch_app("--max-sessions", "1", "--max-new-tokens", "4") as app:
        page = open_page(browser, app)
        ask_and_wait(page, "First question?", 1)
        ask_and_wait(open_page(browser, app), "Another visitor's question?", 1)  # the one session kept is theirs
        send(page, "Second question?")
        page.wait_for_selector("#chatbot >> text=no longer remembers the earlier messages")
        page.wait_for_function("() => !document.querySelector('#ask textarea').disabled")  # answered
        users = page.locator('#chatbot [data-testid="user"]').all_inner_texts()
        assert [u.strip() for u in users] == ["Second question?"]
        assert "total" in answer(page)
