"""--mcp: an agent's MCP client (the `mcp` package, streamable HTTP) finds the `ask` tool and asks it; the README's
MCP commands run as shown."""
import asyncio
import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from qvl import texts
from qvl.serve.ui import ASSETS

ROOT = Path(__file__).resolve().parent.parent
CHART = "data:image/png;base64," + base64.b64encode((ASSETS / "chart.png").read_bytes()).decode()
DEFAULT_URL = "http://127.0.0.1:7860/"


def readme_blocks() -> dict[str, list[str]]:
    """The README's MCP section: its code blocks by language."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n### MCP", 1)[1].split("\n### ", 1)[0]
    blocks = {}
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        blocks.setdefault(language, []).append(body)
    return blocks


def readme_flags() -> list[str]:
    """The flags of the README's start command, `.venv/bin/python app.py --mcp`."""
    [command] = readme_blocks()["bash"]
    program, _, flags = command.strip().partition(" app.py")
    assert program == ".venv/bin/python"
    return flags.split()


@pytest.fixture(scope="module")
def app(launch_app):
    with launch_app(*readme_flags(), "--max-new-tokens", "8") as running:
        deadline = time.monotonic() + 60  # up once it says where its MCP server is: the tool is offered by then
        while "MCP server (streamable HTTP)" not in running.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        yield running


def call(url: str, *requests: tuple[str, dict | None], headers: dict | None = None) -> list:
    """One MCP session: each (tool, arguments) request in turn, None arguments meaning list the tools; headers go
    with every request of the session."""

    async def session():
        async with httpx.AsyncClient(headers=headers, timeout=120) as http, \
                streamable_http_client(url + "gradio_api/mcp/", http_client=http) as (read, write, _), \
                ClientSession(read, write) as client:
            await client.initialize()
            return [await (client.list_tools() if arguments is None else client.call_tool(tool, arguments))
                    for tool, arguments in requests]

    return asyncio.run(session())


def test_an_agent_finds_one_tool_described_for_it_and_gets_answers_and_clear_errors(app):
    tools, answered, refused, empty = call(
        app.url, ("", None), ("ask", {"image": CHART, "question": "Which fruit sold the most?"}),
        ("ask", {"image": "data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "question": "?"}),
        ("ask", {"image": CHART, "question": ""}))
    [tool] = tools.tools  # the API's endpoints are not offered as tools
    assert tool.name == "ask" and "question about a picture" in tool.description
    properties = tool.inputSchema["properties"]
    assert set(properties) == {"image", "question"} and "data: URL" in properties["image"]["description"]
    assert "any language" in properties["question"]["description"]
    assert not answered.isError and answered.content[0].text.strip()
    assert refused.isError and "is not a picture this app can read" in refused.content[0].text
    assert not empty.isError  # a picture alone is a question: the model describes it
    assert "MCP server (streamable HTTP): " + app.url + "gradio_api/mcp/" in app.log.read_text()


def test_a_link_is_refused_in_the_pages_words_without_a_traceback(app):
    """Without --allow-image-urls no link is downloaded: the agent and a client of the `ask` API read why, in their
    language, where Gradio's own download gave its generic error and a traceback."""
    link = app.url + "favicon.ico"
    logged = len(app.log.read_text())
    [english] = call(app.url, ("ask", {"image": link, "question": "?"}))
    [chinese] = call(app.url, ("ask", {"image": link, "question": "?"}), headers={"Accept-Language": "zh-CN"})
    assert english.isError and english.content[0].text == texts.say("en", "image_url_off")
    assert chinese.isError and chinese.content[0].text == texts.say("zh-CN", "image_url_off")
    with pytest.raises(AppError) as refused:
        Client(app.url, verbose=False).predict([handle_file(link)], "?", api_name="/ask")
    assert refused.value.message == texts.say("en", "image_url_off")
    assert "Traceback" not in app.log.read_text()[logged:]


def test_the_readme_mcp_snippets_point_at_the_server_and_its_python_check_runs(app):
    [config] = readme_blocks()["json"]
    assert json.loads(config)["mcpServers"]["qvl"]["url"] == DEFAULT_URL + "gradio_api/mcp/"
    [script] = readme_blocks()["python"]
    assert DEFAULT_URL in script
    done = subprocess.run([sys.executable, "-c", script.replace(DEFAULT_URL, app.url)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tools, answer = done.stdout.split("\n", 1)
    assert tools == "['ask']" and answer.strip()
