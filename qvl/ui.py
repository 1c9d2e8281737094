"""The Gradio page: a chat tab (stream, stop, regenerate, undo, examples) and a settings tab, plus the `ask` API.

Generation runs one request at a time, but Gradio's queue cannot let a cached answer pass a running generation
(an event has one concurrency group), so the answer events run unlimited and take turns in a `Line` of our own:
a cache hit is answered before joining it, the waiting see their place in it, and past its bound the busy message.
"""
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import gradio as gr

from qvl import cpu
from qvl.images import InputError

log = logging.getLogger("qvl")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLES = [
    ("chart.png", "Which fruit sold the most, and how many more boxes than the least popular one?"),
    ("receipt.png", "What is the total on this receipt, and which item cost the most?"),
    ("scene.png", "Describe this picture in one sentence."),
    ("shapes.png", "How many red circles are there?"),
]
# The GenParams fields the Settings tab offers, in its order; the rest (min tokens) stay at the server's flags.
INSTRUCTION_SETS = ("AVX2", "AVX-512", "VNNI", "BF16", "AMX")  # qvl.cpu's names, each shown as present or not
PARAMS = ("max_image_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "greedy", "seed")

TEXT = {
    "en": {
        "title": "## Chat about images with Qwen3-VL, on a CPU",
        "intro": "Add images (upload, drag and drop or paste), ask, press Enter. Answers stream in from this "
                 "machine's CPU; a repeated question is answered from the cache at once.",
        "fallback": "⚠ **Offline fallback**: the real model could not be loaded, so a tiny random model is "
                    "answering: its answers are gibberish. The reason is in Settings.",
        "chat": "Chat", "settings": "Settings", "conversation": "Conversation",
        "placeholder": "Ask about your images… (Enter sends, Shift+Enter for a new line)",
        "stop": "Stop", "regenerate": "Regenerate", "undo": "Undo", "clear": "Clear",
        "examples": "Examples",
        "threads": "Intra-op threads (whole server, applies at once)",
        "interop": "Inter-op threads (applies at restart: --interop-threads)",
        "generation": "### Generation (your session only)",
        "max_image_tokens": "Max image tokens (fewer is faster, more sees finer detail)",
        "max_new_tokens": "Max new tokens", "temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k",
        "greedy": "Greedy (deterministic; ignores temperature, top-p, top-k)", "seed": "Seed",
        "cache": "### Answer cache", "use_cache": "Answer my repeated questions from the cache",
        "cache_clear": "Clear the cache", "refresh": "Refresh",
        "facts": "### This server",
        # Filled in on the server for the browser's language (Accept-Language), so they carry placeholders.
        "waiting": "Waiting in line: {ahead} request(s) ahead of you…",
        "busy": "The server is busy ({size} requests are already waiting). Please try again shortly.",
        "failed": "Something went wrong while answering ({error}). Please try again.",
        "stopped": "stopped",
        "forgotten": "⚠ The server no longer remembers the earlier messages (many visitors came after your last "
                     "one), so this starts a new conversation.",
        "stats": "first token {ttft:.2f} s · {tps:.1f} tok/s · {image_tokens} image tokens · {total:.1f} s total",
        "cached": "cached", "truncated": "hit the max-new-tokens limit",
        "cache_line": "{state} · {entries} answers · {size:.1f} MB · {hits} hits · {misses} misses · "
                      "`{directory}`",
        "on": "on", "off": "off", "broken": "unusable, answering without it",
        "fact_model": "Model", "fact_precision": "Precision / quantization", "fact_threads": "Threads",
        "fact_threads_value": "{threads} intra-op · {interop} inter-op · {cores} cores available",
        "fact_cpu": "CPU", "fact_versions": "Versions", "fact_fallback": "Fallback reason",
    },
    "zh-CN": {
        "title": "## 用 Qwen3-VL 聊图片（CPU 运行）",
        "intro": "添加图片（上传、拖放或粘贴），提问，按回车。"
                 "回答由本机 CPU 逐字生成；重复的问题会立即从缓存回答。",
        "fallback": "⚠ **离线后备模式**：无法加载真实模型，"
                    "当前由一个微型随机模型回答，内容没有意义。原因见“设置”。",
        "chat": "聊天", "settings": "设置", "conversation": "对话",
        "placeholder": "关于图片提问……（回车发送，Shift+回车换行）",
        "stop": "停止", "regenerate": "重新生成", "undo": "撤销", "clear": "清空",
        "examples": "示例",
        "threads": "算子内线程数（全服务器，立即生效）",
        "interop": "算子间线程数（重启后生效：--interop-threads）",
        "generation": "### 生成参数（仅对你的会话）",
        "max_image_tokens": "图片最大 token 数（越少越快，越多细节越清楚）",
        "max_new_tokens": "最大生成 token 数", "temperature": "温度", "top_p": "Top-p", "top_k": "Top-k",
        "greedy": "贪心解码（结果确定；忽略温度、top-p、top-k）", "seed": "随机种子",
        "cache": "### 回答缓存", "use_cache": "重复的问题从缓存回答",
        "cache_clear": "清空缓存", "refresh": "刷新",
        "facts": "### 本服务器",
        "waiting": "排队中：前面还有 {ahead} 个请求……",
        "busy": "服务器繁忙（已有 {size} 个请求在排队），请稍后再试。",
        "failed": "回答时出错（{error}），请重试。",
        "stopped": "已停止",
        "forgotten": "⚠ 服务器已不再记得之前的消息（在您上次提问后来了很多访客），以下是一个新的对话。",
        "stats": "首个 token {ttft:.2f} 秒 · {tps:.1f} token/秒 · 图片 {image_tokens} token · "
                 "共 {total:.1f} 秒",
        "cached": "来自缓存", "truncated": "已达最大生成长度",
        "cache_line": "{state} · {entries} 条回答 · {size:.1f} MB · 命中 {hits} · 未命中 {misses} · "
                      "`{directory}`",
        "on": "开启", "off": "关闭", "broken": "不可用，暂不使用缓存",
        "fact_model": "模型", "fact_precision": "精度 / 量化", "fact_threads": "线程",
        "fact_threads_value": "算子内 {threads} · 算子间 {interop} · 可用核心 {cores}",
        "fact_cpu": "CPU", "fact_versions": "版本", "fact_fallback": "后备原因",
    },
}
I18N = gr.I18n(**TEXT)


class Busy(Exception):
    """The line is full: the request is turned away at once instead of waiting without bound."""


class Line:
    """One generation at a time, first come first served, with at most `size` requests waiting behind it."""

    def __init__(self, size: int):
        self.size = size
        self.tickets: list[object] = []  # the running request first, then the waiting ones in arrival order
        self._moved = asyncio.Event()

    def join(self) -> object:
        if len(self.tickets) > self.size:
            raise Busy(self.size)
        ticket = object()
        self.tickets.append(ticket)
        return ticket

    def ahead(self, ticket) -> int:
        return self.tickets.index(ticket)

    async def moved(self, timeout: float):
        """Return when the line moves, or after `timeout`: a waiting stream still ticks, so a gone client is seen."""
        try:
            await asyncio.wait_for(self._moved.wait(), timeout)
        except TimeoutError:
            pass

    def leave(self, ticket):
        self.tickets.remove(ticket)
        self._moved.set()
        self._moved = asyncio.Event()


@dataclasses.dataclass
class Update:
    """One step of an answer: its place in line while waiting, then the text so far, then the final stats."""

    text: str = ""
    ahead: int = 0
    stats: dict | None = None
    cached: bool = False


def _lang(request: gr.Request | None) -> str:
    """The browser's language, for the text made on the server (labels are translated by Gradio in the page)."""
    accept = (request.headers.get("accept-language", "") if request else "") or ""
    return "zh-CN" if accept.strip().lower().startswith("zh") else "en"


def _problem(lang: str, error: Exception) -> str:
    """What the user is told when there is no answer: how to fix their input, to retry, or what went wrong."""
    if isinstance(error, InputError):
        return str(error)
    if isinstance(error, Busy):
        return TEXT[lang]["busy"].format(size=error.args[0])
    log.error("answer failed", exc_info=error)
    return TEXT[lang]["failed"].format(error=type(error).__name__)


def _stats_line(lang: str, update: Update) -> str:
    s, text = update.stats, TEXT[lang]
    parts = [text["stats"].format(
        ttft=s["ttft_s"], tps=s["decode_tok_s"], image_tokens=s["image_tokens"], total=s["total_s"]
    )]
    if s.get("truncated"):
        parts.append(text["truncated"])
    if update.cached:
        parts.append(text["cached"])
    return " · ".join(parts)


def _turns(conversation: list[dict]):
    """The model's view of a conversation: failed exchanges and notes are for the user's eyes only."""
    from qvl.engine import Turn  # here, not at the top: qvl.engine imports torch, which this module never needs

    return [Turn(e["role"], e["text"], tuple(e["images"])) for e in conversation if not e.get("failed")]


def _render(conversation: list[dict]) -> list[dict]:
    """Chatbot messages: the images then the text of each user turn; each answer with its quiet stats line."""
    messages = []
    for e in conversation:
        if e["role"] == "user":
            content = [{"path": p} for p in e["images"]] + ([e["text"]] if e["text"] else [])
        else:
            note = f"<sub>{e['note']}</sub>" if e.get("note") else ""
            content = "\n\n".join(part for part in (e["text"], note) if part)
        messages.append({"role": e["role"], "content": content})
    return messages


def _asking(possible: bool, **box) -> tuple:
    """Updates for the input box (with a new value, if given) and the Regenerate button: usable or locked."""
    return gr.MultimodalTextbox(interactive=possible, **box), gr.Button(interactive=possible)


def build(engine, cache, settings) -> gr.Blocks:
    line = Line(settings.queue_size)
    identity = engine.identity  # hashes weight files: once, not per request

    async def answer(turns, params, use_cache: bool, fresh: bool):
        """Yield Updates for one answer: a cache hit at once, else the place in line, the stream, the stats.

        Raises InputError (bad input, before any generation), Busy, or whatever generation raised.
        """
        key = None
        if use_cache and cache.enabled and not fresh:
            key = await asyncio.to_thread(cache.key, turns, params, identity)
            hit = await asyncio.to_thread(cache.get, key)
            if hit is not None:
                yield Update(text=hit.text, stats=hit.stats, cached=True)
                return
        ticket = line.join()
        try:
            while ahead := line.ahead(ticket):
                yield Update(ahead=ahead)
                await line.moved(timeout=1.0)
            pieces, step, text, shown = engine.chat(turns, params), None, "", 0.0
            try:
                while True:
                    # Shielded: a cancelled await (Stop) must not leave next() running when the finally closes it.
                    step = asyncio.ensure_future(asyncio.to_thread(next, pieces, None))
                    item = await asyncio.shield(step)
                    if not isinstance(item, str):
                        break
                    text += item
                    # A fast model would send a browser 100 re-renders a second; 20 look the same and cost it less.
                    if time.monotonic() - shown >= 0.05:
                        shown = time.monotonic()
                        yield Update(text=text)
            finally:
                if step is not None:
                    await asyncio.wait([step])
                await asyncio.to_thread(pieces.close)  # stops generation within one step; frees the engine
        finally:
            line.leave(ticket)
        if key is not None:
            await asyncio.to_thread(cache.put, key, text, item)
        yield Update(text=text, stats=dataclasses.asdict(item))

    kinds = {f.name: f.type for f in dataclasses.fields(settings.gen)}

    def params_of(values):
        """GenParams from the Settings controls (sliders send floats; an emptied number box keeps the default)."""
        chosen = {name: kinds[name](value) for name, value in zip(PARAMS, values) if value is not None}
        return replace(settings.gen, **chosen)

    def answering(fresh: bool):
        """The chat tab's answer event: fills the last (assistant) entry of the conversation as the answer comes."""

        async def respond(request: gr.Request, conversation: list, use_cache: bool, *values):
            lang = _lang(request)
            if not conversation or conversation[-1]["role"] != "user":
                yield conversation, _render(conversation)
                return
            params = params_of(values)
            if fresh:  # Regenerate: a new sample, never the cached one
                params = replace(params, seed=random.randrange(2**31))
            turns = _turns(conversation)
            reply = {"role": "assistant", "text": "", "images": [], "note": ""}
            conversation = conversation + [reply]
            try:
                async with contextlib.aclosing(answer(turns, params, use_cache, fresh)) as updates:
                    async for update in updates:
                        reply["text"], reply["done"] = update.text, update.stats is not None
                        reply["note"] = _stats_line(lang, update) if update.stats else (
                            TEXT[lang]["waiting"].format(ahead=update.ahead) if update.ahead else "")
                        yield conversation, _render(conversation)
            except Exception as e:
                note = "⚠ " + _problem(lang, e)
                conversation[-2:] = [dict(conversation[-2], failed=True), dict(reply, note=note, failed=True)]
                yield conversation, _render(conversation)

        return respond

    async def ask(request: gr.Request, images: list[str] | None, question: str, conversation: list,
                  use_cache: bool, max_image_tokens: int, max_new_tokens: int, temperature: float, top_p: float,
                  top_k: int, greedy: bool, seed: int):
        """Answer a question about images, continuing this client's conversation. Streams (answer, status)."""
        lang = _lang(request)
        user = {"role": "user", "text": question or "", "images": list(images or [])}
        params = params_of((max_image_tokens, max_new_tokens, temperature, top_p, top_k, greedy, seed))
        try:
            async with contextlib.aclosing(answer(_turns(conversation + [user]), params, use_cache, False)) as updates:
                async for update in updates:
                    if update.stats is not None:
                        reply = {"role": "assistant", "text": update.text, "images": [], "note": ""}
                        yield update.text, _stats_line(lang, update), conversation + [user, reply]
                    elif update.ahead:
                        yield "", TEXT[lang]["waiting"].format(ahead=update.ahead), conversation
                    else:
                        yield update.text, "", conversation
        except Exception as e:
            raise gr.Error(_problem(lang, e)) from None

    def add_user(message: dict, conversation: list, shown: list, request: gr.Request):
        text, files = (message or {}).get("text", ""), (message or {}).get("files", [])
        if shown and not conversation:  # past --max-sessions Gradio dropped this session's state: say so
            conversation = [{"role": "assistant", "text": "", "images": [], "failed": True,
                             "note": TEXT[_lang(request)]["forgotten"]}]
        conversation = conversation + [{"role": "user", "text": text, "images": list(files)}]
        return conversation, _render(conversation), *_asking(False, value=None)

    def after_stop(conversation: list, request: gr.Request):
        """Keep what was said so far, marked as stopped; an answer that had not begun is dropped."""
        last = conversation[-1] if conversation else {}
        if last.get("role") == "assistant" and not last.get("done") and not last.get("failed"):
            stopped = dict(last, note=TEXT[_lang(request)]["stopped"])
            conversation = conversation[:-1] + ([stopped] if last["text"] else [])
        return conversation, _render(conversation), *_asking(True)

    def drop_answer(conversation: list):
        """Regenerate's first step: the last question without its answer, to be asked again even if it failed."""
        while conversation and conversation[-1]["role"] == "assistant":
            conversation = conversation[:-1]
        if conversation:
            conversation = conversation[:-1] + [dict(conversation[-1], failed=False)]
        return conversation, *_asking(False)

    def undo(conversation: list):
        """Remove the last question and its answer, and put the question back in the input box."""
        last = max((i for i, e in enumerate(conversation) if e["role"] == "user"), default=None)
        if last is None:
            return conversation, _render(conversation), *_asking(True)
        user, conversation = conversation[last], conversation[:last]
        box = {"text": user["text"], "files": user["images"]}
        return conversation, _render(conversation), *_asking(True, value=box)

    def set_threads(n: float, request: gr.Request):
        engine.set_threads(int(n))
        return facts(request)

    def facts(request: gr.Request) -> str:
        text = TEXT[_lang(request)]
        flags = " ".join(f"{name} {'✓' if name in cpu.flags() else '✗'}" for name in INSTRUCTION_SETS)
        versions = " · ".join(f"{p} {_version(p)}" for p in ("torch", "transformers", "gradio"))
        threads = text["fact_threads_value"].format(
            threads=engine.threads, interop=settings.interop_threads, cores=cpu.available_cores())
        rows = [("fact_model", f"`{engine.model_id}`"), ("fact_precision", engine.precision), ("fact_threads", threads),
                ("fact_cpu", f"{cpu.model_name()} · {flags}"), ("fact_versions", versions)]
        if engine.fallback:
            rows.append(("fact_fallback", engine.fallback))
        return "\n".join(f"- **{text[k]}**: {v}" for k, v in rows)

    def cache_status(request: gr.Request) -> str:
        text, info = TEXT[_lang(request)], cache.info()
        state = text["broken"] if info["error"] else text["on"] if info["enabled"] else text["off"]
        line_ = text["cache_line"].format(state=state, entries=info["entries"], size=info["size_bytes"] / 1e6,
                                          hits=info["hits"], misses=info["misses"], directory=info["directory"])
        return line_ + (f"\n\n⚠ `{info['error']}`" if info["error"] else "")

    def clear_cache(request: gr.Request) -> str:
        cache.clear()
        return cache_status(request)

    gen = settings.gen
    keep_s = settings.upload_hours * 3600  # Gradio sweeps every min(hour, keep_s) and never when keep_s is 0
    with gr.Blocks(title="qvl: chat about images on a CPU", delete_cache=(min(3600.0, keep_s), keep_s)) as demo:
        conversation = gr.State([])
        gr.Markdown(I18N("title"))
        with gr.Tabs():
            with gr.Tab(I18N("chat"), id="chat"):
                gr.Markdown(I18N("intro"))
                gr.Markdown(I18N("fallback"), visible=bool(engine.fallback), elem_id="fallback")
                chatbot = gr.Chatbot(label=I18N("conversation"), height=520, elem_id="chatbot",
                                     buttons=["copy", "copy_all"], feedback_options=None)
                box = gr.MultimodalTextbox(
                    file_types=["image"], file_count="multiple", placeholder=I18N("placeholder"), show_label=False,
                    elem_id="ask", autofocus=True,
                )
                with gr.Row():
                    stop = gr.Button(I18N("stop"), variant="stop", elem_id="stop")
                    regenerate = gr.Button(I18N("regenerate"), elem_id="regenerate")
                    undo_btn = gr.Button(I18N("undo"), elem_id="undo")
                    clear = gr.Button(I18N("clear"), elem_id="clear")
                gr.Examples([[{"text": q, "files": [str(ASSETS / f)]}] for f, q in EXAMPLES], inputs=box,
                            label=I18N("examples"), example_labels=[q for _, q in EXAMPLES])
            with gr.Tab(I18N("settings"), id="settings") as settings_tab:
                gr.Markdown(I18N("fallback"), visible=bool(engine.fallback))
                with gr.Row():
                    threads = gr.Slider(1, max(os.cpu_count() or 1, engine.threads), value=engine.threads, step=1,
                                        label=I18N("threads"), elem_id="threads")
                    gr.Number(settings.interop_threads, label=I18N("interop"), interactive=False)
                gr.Markdown(I18N("generation"))
                with gr.Row():
                    controls = [
                        gr.Slider(16, max(4096, gen.max_image_tokens), value=gen.max_image_tokens, step=16,
                                  label=I18N("max_image_tokens")),
                        gr.Slider(1, max(2048, gen.max_new_tokens), value=gen.max_new_tokens, step=1,
                                  label=I18N("max_new_tokens")),
                    ]
                with gr.Row():
                    controls += [
                        gr.Slider(0.05, 2.0, value=gen.temperature, step=0.05, label=I18N("temperature")),
                        gr.Slider(0.05, 1.0, value=gen.top_p, step=0.05, label=I18N("top_p")),
                        gr.Slider(1, 200, value=gen.top_k, step=1, label=I18N("top_k")),
                    ]
                with gr.Row():
                    controls += [
                        gr.Checkbox(gen.greedy, label=I18N("greedy")),
                        gr.Number(gen.seed, label=I18N("seed"), precision=0, minimum=0, maximum=2**32 - 1),
                    ]
                gr.Markdown(I18N("cache"))
                use_cache = gr.Checkbox(cache.enabled, label=I18N("use_cache"), interactive=cache.enabled)
                cache_md = gr.Markdown(elem_id="cache-status")
                with gr.Row():
                    refresh = gr.Button(I18N("refresh"), size="sm")
                    clear_cache_btn = gr.Button(I18N("cache_clear"), size="sm", variant="stop")
                gr.Markdown(I18N("facts"))
                facts_md = gr.Markdown(elem_id="facts")
        # The API: hidden components, so that uploads go through Gradio's file checks like the page's.
        api_images = gr.File(file_count="multiple", file_types=["image"], visible=False, label="images")
        api_question = gr.Textbox(visible=False, label="question")
        api_answer, api_status = gr.Textbox(visible=False, label="answer"), gr.Textbox(visible=False, label="status")

        inputs = [conversation, use_cache, *controls]
        streamed = dict(outputs=[conversation, chatbot], concurrency_limit=None, show_progress="minimal",
                        api_visibility="private")
        # While an answer is written the input box and Regenerate are locked: Stop, Undo and Clear end it first.
        lockable = [box, regenerate]
        reopen = dict(fn=lambda: _asking(True), outputs=lockable, api_visibility="private")
        sent = box.submit(add_user, [box, conversation, chatbot], [conversation, chatbot, *lockable], queue=False,
                          api_visibility="private")
        asked = sent.then(answering(fresh=False), inputs, **streamed)
        asked.then(**reopen)
        again = regenerate.click(drop_answer, conversation, [conversation, *lockable], queue=False,
                                 api_visibility="private")
        redone = again.then(answering(fresh=True), inputs, **streamed)
        redone.then(**reopen)
        running = [asked, redone]
        stop.click(None, cancels=running).then(after_stop, conversation, [conversation, chatbot, *lockable],
                                               api_visibility="private")
        undo_btn.click(undo, conversation, [conversation, chatbot, *lockable], cancels=running,
                       api_visibility="private")
        clear.click(lambda: ([], [], *_asking(True, value=None)), None, [conversation, chatbot, *lockable],
                    cancels=running, api_name="new_conversation")
        gr.Button(visible=False).click(ask, [api_images, api_question, *inputs], [api_answer, api_status, conversation],
                                       concurrency_limit=None, api_name="ask")

        threads.change(set_threads, threads, facts_md, api_visibility="private")
        refresh.click(cache_status, None, cache_md, api_visibility="private")
        settings_tab.select(cache_status, None, cache_md, api_visibility="private")
        clear_cache_btn.click(clear_cache, None, cache_md, api_visibility="private")
        demo.load(facts, None, facts_md, api_visibility="private").then(
            cache_status, None, cache_md, api_visibility="private")
    return demo


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"
