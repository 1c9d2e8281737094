"""The chat tab: the conversation, the input box (send turns into stop while answering), examples in the empty chat.

A conversation is a list of entries {"role", "text", "images", "note"} kept in a gr.State; a user entry marked
"pending" is one waiting for its answer, an entry marked "failed" is shown but never sent to the model, and an answer
without text has an "empty" entry saying so.
"""
import asyncio
import contextlib
import random
from dataclasses import replace
from pathlib import Path

import gradio as gr

from qvl import texts
from qvl.serve import answers
from qvl.settings import SESSION_PARAMS

ASSETS = Path(__file__).resolve().parents[2] / "assets"
EXAMPLES = [("chart.png", "example_chart"), ("receipt.png", "example_receipt"), ("scene.png", "example_scene"),
            ("shapes.png", "example_shapes")]


def render(conversation: list[dict]) -> list[dict]:
    """Chatbot messages: the images then the text of each user turn; each answer (or that there is none) with its
    quiet stats line."""
    messages = []
    for e in conversation:
        if e["role"] == "user":
            content = [{"path": p} for p in e["images"]] + ([e["text"]] if e["text"] else [])
        else:
            note = f"<sub>{e['note']}</sub>" if e.get("note") else ""
            content = "\n\n".join(part for part in (e["text"], e.get("empty"), note) if part)
        messages.append({"role": e["role"], "content": content})
    return messages


def asking(possible: bool, **box) -> gr.MultimodalTextbox:
    """The input box, open with its send button, or locked while an answer is written with a stop button instead."""
    return gr.MultimodalTextbox(interactive=possible, submit_btn=possible, stop_btn=not possible, **box)


def examples(lang: str) -> list[dict]:
    return [{"text": texts.TEXT[lang][key], "files": [str(ASSETS / name)]} for name, key in EXAMPLES]


def welcome(lang: str) -> gr.Chatbot:
    """The empty chat in the browser's language: what to do, and the examples as thumbnails with their question."""
    return gr.Chatbot(placeholder=texts.TEXT[lang]["welcome"], examples=examples(lang))


def draw(i18n: gr.I18n) -> tuple[gr.Chatbot, gr.MultimodalTextbox]:
    chatbot = gr.Chatbot(label=i18n("conversation"), show_label=False, height="64vh", elem_id="chatbot",
                         buttons=["copy", "copy_all"], feedback_options=None, placeholder=texts.TEXT["en"]["welcome"],
                         examples=examples("en"))
    box = gr.MultimodalTextbox(file_types=["image", ".pdf"], file_count="multiple", placeholder=i18n("placeholder"),
                               show_label=False, elem_id="ask", autofocus=True, submit_btn=True, stop_btn=False)
    return chatbot, box


async def until(stop: asyncio.Future, updates):
    """An answer's updates until `stop` is done, which ends them at once, even during a prefill of several seconds."""
    step = None
    try:
        while True:
            step = asyncio.ensure_future(anext(updates, None))
            await asyncio.wait([step, stop], return_when=asyncio.FIRST_COMPLETED)
            if not step.done() or (update := step.result()) is None:
                return
            yield update
    finally:
        if step is not None and not step.done():
            step.cancel()  # the answer leaves the engine to finish its step in the background: this returns promptly
            await asyncio.wait([step])


def wire(chatbot: gr.Chatbot, box: gr.MultimodalTextbox, conversation: gr.State, session: list, answerer):
    """The tab's events. session: the inputs that make a request (conversation, use_cache, then the controls of
    settings.SESSION_PARAMS in that order)."""

    # Stop ends an answer from inside its event rather than through Gradio's `cancels`, whose race with the stream
    # left an "Error" overlay over the chat in a CI run. A session's entry is a future whose result says why the
    # answer ends ("stop" or "clear"); asking anew drops a stale one.
    stops: dict[str, asyncio.Future] = {}

    def answering(fresh: bool):
        """Answer the pending question at the end of the conversation, filling a new assistant entry as it comes."""

        async def respond(request: gr.Request, conversation: list, use_cache: bool, *values):
            lang, session = texts.language(request), request.session_hash
            if not conversation or not conversation[-1].get("pending"):
                yield gr.skip(), gr.skip()
                return
            stop = stops.setdefault(session, asyncio.get_running_loop().create_future())  # Stop may come first
            params = answerer.params(dict(zip(SESSION_PARAMS, values, strict=True)))
            if fresh:  # Regenerate: a new sample, never the cached one
                params = replace(params, seed=random.randrange(2**31))
            reply = {"role": "assistant", "text": "", "images": [], "note": ""}
            conversation = conversation[:-1] + [dict(conversation[-1], pending=False), reply]
            turns, who = answers.turns(conversation[:-1]), answerer.who(request)
            try:
                async with contextlib.aclosing(answerer.answer(turns, params, use_cache, fresh, **who)) as updates:
                    async for update in until(stop, updates):
                        reply["text"], reply["done"] = update.text, update.stats is not None
                        reply["note"] = answers.figures(lang, update) if update.stats else (
                            texts.say(lang, "waiting", ahead=update.ahead) if update.ahead else "")
                        reply["empty"] = answers.no_answer(lang, update)
                        yield conversation, render(conversation)
                if stop.done():
                    conversation = [] if stop.result() == "clear" else stopped(conversation, lang)
                    yield conversation, render(conversation)
            except Exception as e:
                note = "⚠ " + answers.problem(lang, e)
                conversation[-2:] = [dict(conversation[-2], failed=True), dict(reply, note=note, failed=True)]
                yield conversation, render(conversation)
            finally:
                if stops.get(session) is stop:
                    del stops[session]

        return respond

    def stopped(conversation: list, lang: str) -> list:
        """Keep what was said so far, marked as stopped; an answer that had not begun is dropped."""
        last = conversation[-1] if conversation else {}
        if last.get("role") == "assistant" and not last.get("done") and not last.get("failed"):
            marked = dict(last, note=texts.say(lang, "stopped"))
            conversation = conversation[:-1] + ([marked] if last["text"] else [])
        return conversation

    def end_answer(request: gr.Request, why: str):
        stop = stops.setdefault(request.session_hash, asyncio.get_running_loop().create_future())
        if not stop.done():
            stop.set_result(why)

    async def stop_answer(request: gr.Request):  # async: it runs on the event loop, which owns the futures
        end_answer(request, "stop")

    async def clear(request: gr.Request):
        end_answer(request, "clear")
        return [], [], asking(True, value=None)

    def ask(conversation: list, shown: list, request: gr.Request, text: str, files: list):
        lang = texts.language(request)
        stops.pop(request.session_hash, None)  # a Stop from before this question is not for its answer
        if shown and not conversation:  # past --max-sessions Gradio dropped this session's state: say so
            conversation = [{"role": "assistant", "text": "", "images": [], "failed": True,
                             "note": texts.say(lang, "forgotten")}]
        conversation = conversation + [{"role": "user", "text": text, "images": list(files), "pending": True}]
        return conversation, render(conversation), asking(False, value=None)

    def add_user(message: dict, conversation: list, shown: list, request: gr.Request):
        text, files = (message or {}).get("text", ""), (message or {}).get("files", [])
        if not text.strip() and not files:  # Enter on an empty box: nothing to send
            return gr.skip(), gr.skip(), gr.skip()
        return ask(conversation, shown, request, text, files)

    def add_example(conversation: list, shown: list, request: gr.Request, picked: gr.SelectData):
        files = [f["path"] if isinstance(f, dict) else f for f in picked.value.get("files", [])]
        return ask(conversation, shown, request, picked.value.get("text", ""), files)

    def drop_answer(conversation: list, request: gr.Request):
        """Regenerate's first step: the last question without its answer, pending again even if it failed."""
        stops.pop(request.session_hash, None)
        while conversation and conversation[-1]["role"] == "assistant":
            conversation = conversation[:-1]
        if conversation:
            conversation = conversation[:-1] + [dict(conversation[-1], failed=False, pending=True)]
        return conversation, render(conversation), asking(False)

    def undo(conversation: list):
        """Remove the last question and its answer, and put the question back in the input box."""
        last = max((i for i, e in enumerate(conversation) if e["role"] == "user"), default=None)
        if last is None:
            return conversation, render(conversation), asking(True)
        user, conversation = conversation[last], conversation[:last]
        return conversation, render(conversation), asking(True, value={"text": user["text"], "files": user["images"]})

    shown = [conversation, chatbot, box]
    private = dict(api_visibility="private")
    streamed = dict(inputs=session, outputs=[conversation, chatbot], concurrency_limit=None, show_progress="hidden",
                    **private)
    # The small state changes around an answer skip Gradio's queue: queued, they wait behind any other session's
    # queued event in the default group (concurrency 1), and a progress overlay covers the chat meanwhile.
    light = dict(queue=False, show_progress="hidden", **private)
    reopen = dict(fn=lambda: asking(True), outputs=box, **light)
    asked = box.submit(add_user, [box, conversation, chatbot], shown, **light)
    asked = asked.then(answering(fresh=False), **streamed)
    asked.then(**reopen)
    picked = chatbot.example_select(add_example, [conversation, chatbot], shown, **light)
    picked = picked.then(answering(fresh=False), **streamed)
    picked.then(**reopen)
    redone = chatbot.retry(drop_answer, conversation, shown, **light)
    redone = redone.then(answering(fresh=True), **streamed)
    redone.then(**reopen)
    # Undo and Retry are the Chatbot's own icons, disabled while an answer is written; Clear is not, so it ends one.
    box.stop(stop_answer, **light)
    chatbot.undo(undo, conversation, shown, **light)
    chatbot.clear(clear, None, shown, **light)
