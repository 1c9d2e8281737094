"""One answer, as both the page and the API get it: from the cache at once, or after waiting in line, streamed.

Also what the user reads about it: the quiet stats line under an answer, what to do when the model said nothing,
and the message when there is no answer at all.
"""
import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import replace

from qvl import images, texts
from qvl.conversation import EngineError, Turn
from qvl.images import InputError
from qvl.serve import thinking
from qvl.serve.line import Busy, Line, Taken
from qvl.settings import SESSION_PARAMS
from qvl.sizes import parse_size

log = logging.getLogger("qvl")
@dataclasses.dataclass
class Update:
    """One step of an answer: its place in line while waiting, then the text so far, then the final stats."""

    text: str = ""  # the answer, without a Thinking model's reasoning
    ahead: int = 0
    stats: dict | None = None
    cached_in: float | None = None  # seconds a cache hit took, for a cached answer
    reasoning: str | None = None  # a Thinking model's reasoning so far; None for a model that gives none
    thinking: bool = False  # the reasoning has not ended: the model still thinks or, finished, the token cap cut it

    @classmethod
    def of(cls, text: str, final: bool, **rest) -> "Update":
        """An Update of the engine's text so far, its reasoning apart from its answer (qvl.serve.thinking)."""
        reasoning, answer, still = thinking.split(text, final)
        return cls(text=answer, reasoning=reasoning, thinking=still, **rest)


def size_text(n: int) -> str:
    """20971520 -> '20 MB': the unit a person reads (powers of 1024, as --max-file-size counts)."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


class Answerer:
    def __init__(self, engine, cache, settings):
        self.engine, self.cache, self.gen = engine, cache, settings.gen
        # As many run at once as the engine answers at once: a backend's --concurrency, or the local --batch.
        self.line = Line(settings.queue_size, settings.concurrency if settings.backend else settings.batch)
        self.priority_users = set(settings.priority_names)
        self.upload_limit = parse_size(settings.max_file_size)
        self._kinds = {f.name: f.type for f in dataclasses.fields(settings.gen)}
        self._releasing: set[asyncio.Task] = set()  # held here: the event loop keeps only weak references

    def params(self, values: dict) -> object:
        """GenParams from a session's values by name, each one of settings.SESSION_PARAMS (sliders send floats; an
        emptied number box, or a field an API request leaves out, keeps the server's flag)."""
        unknown = set(values) - set(SESSION_PARAMS)
        assert not unknown, f"not a session setting: {unknown}"
        chosen = {name: self._kinds[name](value) for name, value in values.items() if value is not None}
        return replace(self.gen, **chosen)

    def who(self, request) -> dict:
        """answer()'s client and priority for a gr.Request: its Gradio session (a browser tab, a gradio_client
        Client), and 1 for a --priority-users login, else 0."""
        return {"client": request.session_hash, "priority": int(request.username in self.priority_users)}

    def check_uploads(self, turns):
        """Refuse an upload over --max-file-size with our message (Gradio's own is English and counts bytes)."""
        for turn in turns:
            for path in turn.images:
                if isinstance(path, str) and os.path.isfile(path) and os.path.getsize(path) > self.upload_limit:
                    raise InputError("file_too_big", name=os.path.basename(path), limit=size_text(self.upload_limit))

    async def answer(self, turns, params, use_cache: bool, fresh: bool, client: str | None = None,
                     priority: int = 0):
        """Yield Updates for one answer: a cache hit at once, else the place in line, the stream, the stats.

        client and priority place it in line (see who()). Raises InputError (bad input, before any generation), Busy,
        Taken (the client is already in line), or whatever generation raised.
        """
        start, cache, key = time.perf_counter(), self.cache, None
        self.check_uploads(turns)
        if use_cache and cache.enabled and not fresh:
            # Decoded once, for the key and the engine alike; the engine decodes what the key did not need.
            turns = await asyncio.to_thread(images.opened, turns, params)
            key = await asyncio.to_thread(cache.key, turns, params, self.engine.identity)
            hit = await asyncio.to_thread(cache.get, key)
            if hit is not None:
                yield Update.of(hit.text, True, stats=hit.stats, cached_in=time.perf_counter() - start)
                return
        ticket, pieces, step = self.line.join(client, priority), None, None
        try:
            while ahead := self.line.ahead(ticket):
                yield Update(ahead=ahead)
                await self.line.moved(timeout=1.0)
            pieces, text, shown = self.engine.chat(turns, params), "", 0.0
            while True:
                # Shielded: a cancelled await (Stop, a gone client) leaves next() to finish in _release, never
                # closes the generator under a running step.
                step = asyncio.ensure_future(asyncio.to_thread(next, pieces, None))
                item = await asyncio.shield(step)
                if not isinstance(item, str):
                    break
                text += item
                # A fast model would send a browser 100 re-renders a second; 20 look the same and cost it less.
                if time.monotonic() - shown >= 0.05:
                    shown = time.monotonic()
                    yield Update.of(text, False)
        except BaseException:
            self.line.abandon(ticket)  # the client may ask again at once, behind what is left of this one
            # Whoever stopped the answer does not wait for the engine's current step (a prefill takes seconds): it is
            # freed in the background, and the next in line starts once it is.
            task = asyncio.ensure_future(self._release(ticket, pieces, step))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            raise
        await self._release(ticket, pieces, step)
        if key is not None:
            await asyncio.to_thread(cache.put, key, text, item)
        yield Update.of(text, True, stats=dataclasses.asdict(item))

    async def _release(self, ticket, pieces, step):
        try:
            if step is not None:
                await asyncio.wait([step])
            if pieces is not None:
                await asyncio.to_thread(pieces.close)  # stops generation within one step; frees the engine
        finally:
            self.line.leave(ticket)


def problem(lang: str, error: Exception) -> str:
    """What the user is told when there is no answer: how to fix their input, to retry, or that it went wrong.

    Bad input is one line in the log (with the library's own wording, which the user never sees); a real fault
    gets its traceback.
    """
    if isinstance(error, InputError):
        log.info("refused: %s%s", error, f" ({error.detail})" if error.detail else "")
        return error.say(lang)
    if isinstance(error, Busy):
        return texts.say(lang, "busy", size=error.args[0])
    if isinstance(error, Taken):
        return texts.say(lang, "one_at_a_time")
    if isinstance(error, EngineError):
        log.warning("no answer: %s", error)
        return texts.say(lang, error.key, **error.params)
    log.error("answer failed", exc_info=error)
    return texts.say(lang, "failed")


def no_answer(lang: str, update: Update) -> str:
    """For a finished answer without text (the model stopped at once, wrote only blank lines, or was still thinking
    at the token cap): what to do. Else ""."""
    if update.stats is None or update.text.strip():
        return ""
    return texts.say(lang, "thought_cut" if update.thinking and update.stats.get("truncated") else "no_answer")


def thought(lang: str, update: Update) -> dict | None:
    """The reasoning's title, status and (once the answer is done) how long it took, as Gradio's Chatbot metadata
    shows a thought: open with a spinner while pending, collapsed when done. None for an answer without reasoning."""
    pending = update.thinking and update.stats is None
    if update.reasoning is None or not (update.reasoning or pending):
        return None
    seconds = {"duration": round(update.stats.get("thinking_s", 0.0), 1)} if update.stats is not None else {}
    return {"title": texts.say(lang, "thinking"), "status": "pending" if pending else "done", **seconds}


def stats_line(lang: str, update: Update) -> str:
    """The status of a finished answer: no_answer's message for an empty one (beside its empty text it is all that an
    API client reads), then its figures."""
    return " · ".join(filter(None, (no_answer(lang, update), figures(lang, update))))


def figures(lang: str, update: Update) -> str:
    """The quiet line under a finished answer: its speed (or that it came from the cache), reuse, the token cap."""
    s = update.stats
    if update.cached_in is not None:
        return texts.say(lang, "from_cache", elapsed=update.cached_in, total=s["total_s"])
    parts = [texts.say(lang, "stats", ttft=s["ttft_s"], tps=s["decode_tok_s"], image_tokens=s["image_tokens"],
                       total=s["total_s"])]
    if s.get("thinking_s"):
        parts.append(texts.say(lang, "thought_for", seconds=s["thinking_s"]))
    if s.get("video_frames"):
        parts.append(texts.say(lang, "video_part", frames=s["video_frames"], tokens=s["video_tokens"]))
    if s.get("batch", 1) > 1:  # its tokens/s is its own share of steps it took with the others
        parts.append(texts.say(lang, "batch_part", count=s["batch"]))
    if s.get("reused_tokens"):
        parts.append(texts.say(lang, "reused", tokens=s["reused_tokens"], prompt=s["prompt_tokens"]))
    if s.get("cached_images"):
        parts.append(texts.say(lang, "features_cached", count=s["cached_images"]))
    if s.get("truncated"):
        parts.append(texts.say(lang, "truncated"))
    return " · ".join(parts)


def turns(conversation: list[dict]):
    """The model's view of a conversation: failed exchanges and notes are for the user's eyes only."""
    return [Turn(e["role"], e["text"], tuple(e["images"])) for e in conversation if not e.get("failed")]
