"""The MCP tool (--mcp): `ask`, one question about a picture, for agents, served by Gradio's MCP server.

Gradio makes a tool of every named endpoint, but 6.31 cannot serve the API's `ask` as one: its list of files reaches
the MCP input check with a dangling `$ref` (every call with an image is refused), and its conversation output (a
gr.State) makes Gradio's result handling fail. So the tool has an endpoint of its own, shaped for what Gradio's MCP
server handles (one file in, text out), and agents see only it. Gradio calls every tool through one loopback client,
so each call is a new conversation and the one-place rule cannot tell callers apart: tool calls are not held to it.
"""
import contextlib
import warnings

import gradio as gr

from qvl import answers, texts

NAME, ENDPOINT = "ask", "/ask_tool"


def wire(answerer):
    # Gradio warns at start-up that a tool has a gr.State input: the API's `ask`, which agents are not offered.
    warnings.filterwarnings("ignore", message="This MCP server includes a tool that has a gr.State input")

    async def ask(request: gr.Request, image: str | None, question: str) -> str:
        """Ask the vision-language model Qwen3-VL, running on this server's CPU, a question about a picture (a chart,
        a receipt, a photo, a screenshot, a scanned page): describe it, read its text, count or compare things in it.
        Each call is a new conversation, so put everything the question needs into it. Returns the answer as text.
        A repeated picture and question is answered at once from the server's cache; otherwise the call may first
        wait for other users' answers.

        Args:
            image: the picture, as an http(s) URL or a data: URL (PNG, JPEG, WebP or GIF)
            question: what to ask about the picture, in any language (English and Chinese work best)
        """
        lang, text = texts.language(request), ""
        try:
            turns = answers.turns([{"role": "user", "text": question or "", "images": [image] if image else []}])
            async with contextlib.aclosing(answerer.answer(turns, answerer.gen, True, False)) as updates:
                async for update in updates:
                    text = update.text
        except Exception as e:  # bad input or a full line: the agent reads the same message a user would
            raise gr.Error(answers.problem(lang, e), print_exception=False) from None
        return text

    image = gr.File(visible=False, label="image")
    question, answer = gr.Textbox(visible=False, label="question"), gr.Textbox(visible=False, label="answer")
    gr.Button(visible=False).click(ask, [image, question], answer, concurrency_limit=None,
                                   api_name=ENDPOINT.lstrip("/"))


def offer(demo: gr.Blocks):
    """After launch: agents see the tool, not the API's endpoints (which Gradio would offer as tools too)."""
    demo.mcp_server_obj.tool_to_endpoint = {NAME: ENDPOINT}
