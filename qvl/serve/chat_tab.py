"""The chat tab: the conversation, the input box (send turns into stop while answering), examples in the empty chat,
and the sidebar of conversations kept in the browser (qvl.serve.history).

A conversation is a list of entries {"role", "text", "images", "note"} kept in a gr.State; a user entry marked
"pending" is one waiting for its answer, an entry marked "failed" is shown but never sent to the model, and an answer
without text has an "empty" entry saying so. An answer with boxes or points has them drawn on its image in a
"drawn" entry, shown under it and never sent to the model (qvl.serve.boxes).
"""
import asyncio
import contextlib
import os
import random
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import gradio as gr

from qvl import texts
from qvl.conversation import InputError
from qvl.serve import answers, boxes, history
from qvl.settings import SESSION_PARAMS

ASSETS = Path(__file__).resolve().parents[2] / "assets"
EXAMPLES = [("chart.png", "example_chart"), ("receipt.png", "example_receipt"), ("scene.png", "example_scene"),
            ("shapes.png", "example_shapes")]


def render(conversation: list[dict]) -> list[dict]:
    """Chatbot messages: the images then the text of each user turn; each answer (or that there is none) with its
    quiet stats line, after its reasoning's own message (a Thinking model's), collapsed under a title."""
    messages = []
    for e in conversation:
        if e.get("thought"):  # Gradio's metadata (answers.thought) makes a message of it a thought
            messages.append({"role": "assistant", "content": e["reasoning"], "metadata": e["thought"]})
        if e["role"] == "user":
            content = [{"path": p} for p in e["images"]] + ([e["text"]] if e["text"] else [])
        else:
            note = f"<sub>{e['note']}</sub>" if e.get("note") else ""
            content = "\n\n".join(part for part in (e["text"], e.get("empty"), note) if part)
            if e.get("drawn"):  # its boxes and points drawn on the image, under the answer
                content = [content, e["drawn"]]
        messages.append({"role": e["role"], "content": content})
    return messages


def drawn(conversation: list[dict], text: str, lang: str, folder: str) -> dict | None:
    """An answer's boxes and points drawn on the image they refer to (boxes.grounded), as Chatbot content: a PNG in
    `folder`, Gradio's own, which serves it (the picture opens full size and downloads) and sweeps it with the
    uploads. None for an answer without any."""
    image, marks = boxes.grounded(conversation, text)
    if not marks:
        return None
    handle, path = tempfile.mkstemp(prefix="boxes-", suffix=".png", dir=folder)
    with os.fdopen(handle, "wb") as file:
        boxes.draw(image, marks).save(file, "PNG")
    return {"path": path, "alt_text": texts.say(lang, "drawn")}


def reopened(kept: dict, folder: str, lang: str) -> list[dict]:
    """A kept conversation in the chat again (history.restore), each answer's boxes drawn again on their picture."""
    conversation = history.restore(kept, folder)
    for i, e in enumerate(conversation):
        if e.get("drawn"):
            e["drawn"] = drawn(conversation[:i], e["text"], lang, folder)
    return conversation


def entry(conversation: list[dict], message: int) -> int:
    """The index in the conversation of the entry that render()'s message number `message` shows (an answer with
    reasoning shows two), len(conversation) for one past its end."""
    owners = [i for i, e in enumerate(conversation) for _ in range(1 + bool(e.get("thought")))]
    return owners[message] if message < len(owners) else len(conversation)


def asking(possible: bool, **box) -> gr.MultimodalTextbox:
    """The input box, open with its send button, or locked while an answer is written with a stop button instead."""
    return gr.MultimodalTextbox(interactive=possible, submit_btn=possible, stop_btn=not possible, **box)


def examples(lang: str) -> list[dict]:
    return [{"text": texts.TEXT[lang][key], "files": [str(ASSETS / name)]} for name, key in EXAMPLES]


def welcome(lang: str) -> gr.Chatbot:
    """The empty chat in the browser's language: what to do, and the examples as thumbnails with their question."""
    return gr.Chatbot(placeholder=texts.TEXT[lang]["welcome"], examples=examples(lang))


def draw(i18n: gr.I18n) -> tuple[gr.Chatbot, gr.MultimodalTextbox]:
    # Each picture and text in a bubble of its own: Gradio 6.31 cannot edit a bubble that holds a picture (its Edit
    # fails on the picture and sends nothing), and a question's text alone can.
    chatbot = gr.Chatbot(label=i18n("conversation"), show_label=False, height="64vh", elem_id="chatbot",
                         buttons=["copy", "copy_all"], feedback_options=None, placeholder=texts.TEXT["en"]["welcome"],
                         examples=examples("en"), editable="user", group_consecutive_messages=False)
    box = gr.MultimodalTextbox(file_types=["image", ".pdf", "video"], file_count="multiple",
                               placeholder=i18n("placeholder"), show_label=False, elem_id="ask", autofocus=True,
                               submit_btn=True, stop_btn=False)
    return chatbot, box


def draw_kept(i18n: gr.I18n) -> dict:
    """The sidebar: the conversations kept in this browser, newest first, and what to do with them."""
    with gr.Sidebar(label=i18n("conversations"), open=False, elem_id="kept"):
        # A fixed key and secret: the secret travels with the page, so it hides nothing from the visitor whose
        # browser this is, and a fixed one keeps the conversations readable after the server restarts.
        parts = {"store": gr.BrowserState([], storage_key="qvl-conversations", secret="qvl-conversations"),
                 "new": gr.Button(i18n("new_conversation"), variant="primary", size="sm", elem_id="kept-new"),
                 "list": gr.Radio([], label=i18n("conversations"), show_label=False, elem_id="kept-list"),
                 "delete": gr.Button(i18n("delete_conversation"), size="sm", elem_id="kept-delete"),
                 "markdown": gr.DownloadButton(i18n("download_markdown"), size="sm", interactive=False),
                 "json": gr.DownloadButton(i18n("download_json"), size="sm", interactive=False, elem_id="kept-json"),
                 "upload": gr.UploadButton(i18n("upload_conversation"), file_types=[".json"], size="sm",
                                           elem_id="kept-upload")}
        gr.Markdown(i18n("kept_here"), elem_id="kept-here")
    return parts


def listing(store: list[dict], current: str | None = None) -> gr.Radio:
    """The sidebar's list: each kept conversation by its title, `current` chosen."""
    return gr.Radio(choices=[(kept["title"], kept["id"]) for kept in store], value=current)


def edited(conversation: list[dict], index: int, text: str) -> list[dict] | None:
    """The conversation asked again from its question at `index`, with `text` now: the turns before it, then the
    question with its images, waiting for its answer. None for a question emptied of everything."""
    if not (text.strip() or conversation[index]["images"]):
        return None
    return conversation[:index] + [dict(conversation[index], text=text, pending=True, failed=False)]


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


def wire(chatbot: gr.Chatbot, box: gr.MultimodalTextbox, conversation: gr.State, session: list, answerer,
         kept: dict):
    """The tab's events. session: the inputs that make a request (conversation, use_cache, then the controls of
    settings.SESSION_PARAMS in that order); kept: the sidebar's parts (draw_kept)."""

    # Stop ends an answer from inside its event rather than through Gradio's `cancels`, whose race with the stream
    # left an "Error" overlay over the chat in a CI run. A session's entry is a future whose result says why the
    # answer ends ("stop" or "clear"); asking anew drops a stale one.
    stops: dict[str, asyncio.Future] = {}

    def answering(fresh: bool):
        """Answer the pending question at the end of the conversation, filling a new assistant entry as it comes."""

        async def respond(request: gr.Request, shown: list, conversation: list, use_cache: bool, *values):
            lang, session = texts.language(request), request.session_hash
            if not conversation and shown:  # past --max-sessions Gradio dropped the state since the page showed it
                conversation = [{"role": "assistant", "text": "", "images": [], "failed": True,
                                 "note": texts.say(lang, "forgotten_asked")}]
                yield conversation, render(conversation)
                return
            if not conversation or not conversation[-1].get("pending"):  # nothing asked (Enter on an empty box)
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
                        reply["reasoning"], reply["thought"] = update.reasoning, answers.thought(lang, update)
                        reply["note"] = answers.figures(lang, update) if update.stats else (
                            texts.say(lang, "waiting", ahead=update.ahead) if update.ahead else "")
                        reply["empty"] = answers.no_answer(lang, update)
                        if update.stats is not None:  # kept apart from "images", which the model is sent
                            reply["drawn"] = await asyncio.to_thread(drawn, conversation[:-1], update.text, lang,
                                                                     chatbot.GRADIO_CACHE)
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
            if last.get("thought"):  # its reasoning so far, no longer pending
                marked["thought"] = dict(last["thought"], status="done")
            conversation = conversation[:-1] + ([marked] if last["text"] or last.get("reasoning") else [])
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

    def edit(conversation: list, shown: list, request: gr.Request, change: gr.EditData):
        """An edited question replaces its turn and the turns after it go; it is answered again, after the turns
        before it sent unchanged, so that conversation memory reuses them."""
        index = entry(conversation, change.index)
        if index >= len(conversation):  # past --max-sessions Gradio dropped this session's state: say so
            return ask(conversation, shown, request, change.value, [])
        asked = edited(conversation, index, change.value)
        if asked is None:  # emptied: the question stays as it was
            return conversation, render(conversation), gr.skip()
        stops.pop(request.session_hash, None)
        return asked, render(asked), asking(False)

    def offered(record: dict | None, lang: str = "en") -> list:
        """The download buttons with the shown conversation's files (swept with the uploads), or none to offer."""
        if record is None:
            return [gr.DownloadButton(value=None, interactive=False)] * 2
        files = [(history.to_zip(record, lang), history.file_name(record, "zip")),
                 (history.to_json(record), history.file_name(record, "json"))]
        return [gr.DownloadButton(value=history.written(chatbot.GRADIO_CACHE, data, name), interactive=True)
                for data, name in files]

    def keep(conversation: list, store: list, current: str | None, request: gr.Request):
        """After each answer or undo: the conversation kept in the browser, first in the list, and offered for
        download."""
        if not any(e["role"] == "user" for e in conversation):
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        lang = texts.language(request)
        record = history.record(conversation, current or uuid.uuid4().hex, lang)
        store = history.keep(store, record)
        return store, listing(store, record["id"]), *offered(record, lang)

    def open_kept(current: str | None, store: list, request: gr.Request):
        """The conversation chosen in the list, in the chat again, its pictures where the model reads them."""
        record = next((k for k in store if k["id"] == current), None)
        if record is None:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        lang = texts.language(request)
        conversation = reopened(record, chatbot.GRADIO_CACHE, lang)
        return conversation, render(conversation), *offered(record, lang)

    def add_upload(path: str, store: list, request: gr.Request):
        """A downloaded JSON kept again, first in the list; anything else is refused with a message."""
        try:
            record = history.from_json(Path(path).read_bytes(), uuid.uuid4().hex)
        except InputError as e:  # logged as one line, as bad input is; a toast in the user's language
            raise gr.Error(answers.problem(texts.language(request), e), print_exception=False) from None
        store = history.keep(store, record)
        return store, listing(store, record["id"])

    def delete(current: str | None, store: list):
        """The chosen conversation gone from the browser (Clear's step emptied the chat)."""
        store = [k for k in store if k["id"] != current]
        return store, listing(store), *offered(None)

    shown = [conversation, chatbot, box]
    private = dict(api_visibility="private")
    streamed = dict(inputs=[chatbot, *session], outputs=[conversation, chatbot], concurrency_limit=None,
                    show_progress="hidden", **private)
    # The small state changes around an answer skip Gradio's queue: queued, they wait behind any other session's
    # queued event in the default group (concurrency 1), and a progress overlay covers the chat meanwhile.
    light = dict(queue=False, show_progress="hidden", **private)
    reopen = dict(fn=lambda: asking(True), outputs=box, **light)
    # Each conversation is kept in the browser once it settles: after each answer, and after Undo.
    store, listed, downloads = kept["store"], kept["list"], [kept["markdown"], kept["json"]]
    keeping = dict(fn=keep, inputs=[conversation, store, listed], outputs=[store, listed, *downloads], **light)
    asked = box.submit(add_user, [box, conversation, chatbot], shown, **light)
    asked = asked.then(answering(fresh=False), **streamed)
    asked.then(**reopen).then(**keeping)
    picked = chatbot.example_select(add_example, [conversation, chatbot], shown, **light)
    picked = picked.then(answering(fresh=False), **streamed)
    picked.then(**reopen).then(**keeping)
    redone = chatbot.retry(drop_answer, conversation, shown, **light)
    redone = redone.then(answering(fresh=True), **streamed)
    redone.then(**reopen).then(**keeping)
    changed = chatbot.edit(edit, [conversation, chatbot], shown, **light)
    changed = changed.then(answering(fresh=False), **streamed)
    changed.then(**reopen).then(**keeping)
    # Undo, Retry and Edit are the Chatbot's own icons, disabled while an answer is written; Clear is not, so it ends
    # one, and so does whatever shows another conversation (by Clear's own step first).
    box.stop(stop_answer, **light)
    chatbot.undo(undo, conversation, shown, **light).then(**keeping)
    emptied = gr.on([chatbot.clear, kept["new"].click], clear, None, shown, **light)
    emptied.then(lambda: (gr.Radio(value=None), *offered(None)), None, [listed, *downloads], **light)
    opening = dict(fn=open_kept, inputs=[listed, store], outputs=[conversation, chatbot, *downloads], **light)
    listed.input(clear, None, shown, **light).then(**opening)
    # Queued, unlike its neighbours: a refusal's toast needs the queue.
    uploaded = kept["upload"].upload(add_upload, [kept["upload"], store], [store, listed], show_progress="hidden",
                                     **private)
    uploaded.success(clear, None, shown, **light).then(**opening)
    deleted = kept["delete"].click(clear, None, shown, **light)
    deleted.then(delete, [listed, store], [store, listed, *downloads], **light)
