"""Who may come in by which door. With --api-key and no --auth every door needs the key: the page, Gradio's API (its
config, info, `ask` called or queued, uploads, the files it serves), the MCP tool and the OpenAI API; clients that send
it get in. With --auth, Gradio's login closes its doors and the page offers the login. A picture's link is read by qvl
at every door, and the API page's example runs as it is shown."""
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError, AuthenticationError

from qvl import texts
from qvl.serve import api
from qvl.serve.ui import ASSETS
from test_mcp import CHART as CHART_URL, call
from test_openai_api import KEY, ready, serving

CHART = ASSETS / "chart.png"
BEARER = {"Authorization": f"Bearer {KEY}"}
# Gradio's doors that its login closes too: (method, path).
GRADIO_DOORS = [("GET", "config"), ("GET", "gradio_api/info"), ("POST", "gradio_api/call/ask"),
                ("POST", "gradio_api/queue/join"), ("POST", "gradio_api/upload"), ("GET", f"gradio_api/file={CHART}"),
                ("GET", "v1/models")]
# With the key alone, also the page, the MCP tool and its endpoint, which is called outside Gradio's queue.
KEY_DOORS = [("GET", ""), ("POST", "gradio_api/mcp/"), ("POST", "gradio_api/run/ask_tool"), *GRADIO_DOORS]


@pytest.fixture(scope="module")
def app(launch_app):
    with launch_app("--api-key", KEY, "--mcp", "--allow-image-urls", "--max-new-tokens", "8") as running:
        ready(running.url, KEY)
        yield running


def test_without_the_key_no_door_opens(app):
    for method, path in KEY_DOORS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            assert httpx.request(method, app.url + path, headers=headers).status_code == 401, (method, path, headers)
    assert httpx.get(f"{app.url}gradio_api/file={CHART}", headers=BEARER).content == CHART.read_bytes()


def test_a_browser_reads_that_the_page_needs_auth_in_its_language(app):
    for lang in texts.LANGUAGES:
        page = httpx.get(app.url, headers={"Accept": "text/html", "Accept-Language": lang})
        assert page.status_code == 401 and page.headers["www-authenticate"] == "Bearer"
        assert texts.say(lang, "api_key") in page.text and texts.say(lang, "page_needs_auth") in page.text
    log = app.log.read_text()  # the operator is not sent to a page that refuses browsers
    assert f"qvl is up at {app.url.rstrip('/')}" in log and "open http" not in log and "add --auth" in log


def test_clients_that_send_the_key_get_answers_from_gradios_api_and_the_mcp_tool(app):
    answer, status, _ = Client(app.url, headers=BEARER, verbose=False).predict(
        [handle_file(CHART)], "What is this?", api_name="/ask")
    assert answer and "image tokens" in status
    with pytest.raises(AuthenticationError):
        Client(app.url, verbose=False)
    # Gradio's MCP server calls the tool in this process: nothing of it knocks again without the key.
    [answered] = call(app.url, ("ask", {"image": CHART_URL, "question": "What is this?"}), headers=BEARER)
    assert not answered.isError and answered.content[0].text


def test_a_link_to_this_machine_is_refused_in_the_pages_words_by_every_door(app):
    link, logged = app.url + "favicon.ico", len(app.log.read_text())
    blocked = texts.say("en", "image_url_blocked", host="127.0.0.1")  # --allow-image-urls, but not from here
    [refused] = call(app.url, ("ask", {"image": link, "question": "?"}), headers=BEARER)
    assert refused.isError and refused.content[0].text == blocked
    with pytest.raises(AppError) as asked:
        Client(app.url, headers=BEARER, verbose=False).predict([handle_file(link)], "?", api_name="/ask")
    assert asked.value.message == blocked
    assert "Traceback" not in app.log.read_text()[logged:]


def test_with_auth_the_page_offers_the_login_and_gradios_doors_need_it(engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--auth", "ann:pw", "--api-key", KEY, "--max-new-tokens", "2") as url:
        assert httpx.get(url).status_code == 200  # the login form, for visitors
        for method, path in GRADIO_DOORS:
            assert httpx.request(method, url + path).status_code == 401, (method, path)
        assert httpx.get(url + "v1/models", headers=BEARER).status_code == 200
        answer, _, _ = Client(url, auth=("ann", "pw"), verbose=False).predict([], "Hi", api_name="/ask")
        assert answer


def test_the_api_pages_example_is_a_picture_and_runs_as_shown(engine, tmp_path):
    engine.ready.set()
    with serving(engine, tmp_path, "--max-new-tokens", "2") as url:
        snippet = httpx.get(url + "gradio_api/info").json()["named_endpoints"]["/ask"]["code_snippets"]["python"]
        [link] = re.findall(r"handle_file\('([^']+)'\)", snippet)
        assert link == f"{url}gradio_api/file={quote(str(CHART))}"
        assert httpx.get(link).content == CHART.read_bytes()  # it opens in a browser too
        done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"· [1-9]\d* image tokens ·", done.stdout), done.stdout  # the picture was read


def test_only_the_example_pictures_are_read_from_disk_by_their_link():
    assert api.example_picture(f"http://elsewhere:80/gradio_api/file={quote(str(CHART))}") == str(CHART)
    for other in (ASSETS / "make_examples.py", ASSETS / ".." / "app.py", Path("/etc/passwd")):
        assert api.example_picture(f"http://127.0.0.1:7860/gradio_api/file={other}") is None
    assert api.example_picture(f"http://127.0.0.1:7860/gradio_api/proxy={CHART}") is None
