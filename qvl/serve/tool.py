"""The MCP tool (--mcp): `ask`, one question about a picture, for agents, served by Gradio's MCP server.

Gradio makes a tool of every named endpoint, but 6.31 cannot serve the API's `ask` as one: its list of files reaches
the MCP input check with a dangling `$ref` (every call with an image is refused), and its conversation output (a
gr.State) makes Gradio's result handling fail. So the tool has an endpoint of its own, shaped for what Gradio's MCP
server handles (text in, text out), and agents see only it. Its picture is a link that qvl reads as the OpenAI API
does (a gr.File would have Gradio download it, refusing a link in its own words with a traceback in the log). Each
call is a new conversation and tool calls cannot be told apart (they share no session), so they are not held to the
one-place rule.
"""
import contextlib
import warnings

import gradio as gr

from qvl import texts
from qvl.serve import answers, links

NAME, ENDPOINT = "ask", "/ask_tool"


class Refusal(gr.Error):
    """A gr.Error whose str() is its message: Gradio's MCP server gives the agent str(), which for gr.Error is repr()
    (the message in quotes)."""

    def __str__(self) -> str:
        return self.message


def wire(answerer, settings):
    # Gradio warns at start-up that a tool has a gr.State input: the API's `ask`, which agents are not offered.
    warnings.filterwarnings("ignore", message="This MCP server includes a tool that has a gr.State input")

    async def ask(request: gr.Request, image: str | None, question: str) -> str:
        """Ask the vision-language model Qwen3-VL, running on this server's CPU, a question about a picture (a chart,
        a receipt, a photo, a screenshot, a scanned page): describe it, read its text, count or compare things in it.
        Each call is a new conversation, so put everything the question needs into it. Returns the answer as text.
        A repeated picture and question is answered at once from the server's cache; otherwise the call may first
        wait for other users' answers.

        Args:
            image: the picture as a data: URL (PNG, JPEG, WebP or GIF), or its http(s) URL if the server takes links
            question: what to ask about the picture, in any language (English and Chinese work best)
        """
        lang, text = texts.language(request), ""
        try:
            pictures = [await links.read(image, "image", settings.allow_image_urls, answerer.upload_limit)] if image \
                else []
            turns = answers.turns([{"role": "user", "text": question or "", "images": pictures}])
            async with contextlib.aclosing(answerer.answer(turns, answerer.gen, True, False)) as updates:
                async for update in updates:
                    text = update.text
        except Exception as e:  # bad input or a full line: the agent reads the same message a user would
            raise Refusal(answers.problem(lang, e), print_exception=False) from None
        return text

    image, question = gr.Textbox(visible=False, label="image"), gr.Textbox(visible=False, label="question")
    answer = gr.Textbox(visible=False, label="answer")
    # Off Gradio's queue, its MCP server calls the function in-process; queued, it would call it over HTTP through a
    # client of its own, which sends no key past the --api-key guard (qvl.serve.doors). The line is qvl's own anyway.
    gr.Button(visible=False).click(ask, [image, question], answer, queue=False, api_name=ENDPOINT.lstrip("/"))


def offer(demo: gr.Blocks):
    """After launch: agents see the tool, not the API's endpoints (which Gradio would offer as tools too)."""
    demo.mcp_server_obj.tool_to_endpoint = {NAME: ENDPOINT}
