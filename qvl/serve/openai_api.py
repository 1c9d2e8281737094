"""The OpenAI chat API on the page's own server: POST /v1/chat/completions and GET /v1/models.

It answers through the same Answerer as the page and `ask`: the same line, answer cache, engine and kept
conversations (matched by content, so a follow-up that resends the conversation reuses its prefix). A Thinking model's
reasoning is the message's reasoning_content, as vLLM and llama-server send it, and its answer the content. Errors are
OpenAI error objects with the page's wording, in the request's Accept-Language.
"""
import contextlib
import json
import time
import uuid
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qvl import settings, texts
from qvl.conversation import EngineError, InputError
from qvl.serve import answers, doors, links
from qvl.serve.line import Busy, Taken

RETRY_AFTER_S = 5  # while the model loads and warms up: seconds on a second start, minutes on a first


class Refused(Exception):
    """A request refused before it is looked at: a missing key (401) or an engine still warming up (503, saying what
    the start does now: Engine.progress())."""

    def __init__(self, status: int, key: str, progress: tuple | None = None):
        super().__init__(key)
        self.status, self.key, self.progress = status, key, progress

    def say(self, lang: str) -> str:
        return texts.say(lang, self.key, now=self.progress and texts.starting(lang, self.progress))


def _number(body: dict, name: str, kind: type, low: float, high: float):
    """body[name] as kind, None when absent; out of [low, high] or of another type is a bad request."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high or (
            kind is int and value != int(value)):
        raise InputError("bad_field", field=name)
    return kind(value)


def cut(text: str, stops: list[str], final: bool) -> tuple[str, bool]:
    """What may be shown of the answer so far: up to its first stop sequence, and whether there was one. While it
    streams, a tail as long as a stop sequence could be the start of one, so it waits for more text."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    if ends:
        return text[:min(ends)], True
    hold = 0 if final else max((len(s) - 1 for s in stops), default=0)
    return text[:len(text) - hold], False


def usage(stats: dict | None) -> dict | None:
    """OpenAI's usage from an answer's Stats; prompt tokens reused from a kept conversation count as cached."""
    if stats is None:
        return None
    return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["new_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
            "prompt_tokens_details": {"cached_tokens": stats.get("reused_tokens", 0)}}


def status_line(lang: str, last) -> str | None:
    """The quiet line the page shows under an answer (speed, reuse, or that it came from the cache): qvl's own field."""
    return answers.stats_line(lang, last) if last is not None else None


def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def failure(lang: str, e: Exception) -> JSONResponse:
    """The error response for an exception, with the wording the page would show (answers.problem logs it)."""
    if isinstance(e, Refused):
        kind = "authentication_error" if e.status == 401 else "service_unavailable"
        refused = error(e.status, e.say(lang), kind)
        if e.status == 503:  # OpenAI's clients wait this long before they retry, instead of their own backoff
            refused.headers["Retry-After"] = str(RETRY_AFTER_S)
        return refused
    message = answers.problem(lang, e)
    if isinstance(e, InputError):
        return error(400, message, "invalid_request_error",
                     "context_length_exceeded" if e.key.startswith("too_long") else e.key)
    if isinstance(e, Busy):
        return error(429, message, "rate_limit_error", "server_busy")
    if isinstance(e, Taken):
        return error(429, message, "rate_limit_error", "one_at_a_time")
    if isinstance(e, EngineError):  # the model server behind this one (--backend) did not answer
        return error(502, message, "upstream_error", e.key)
    return error(500, message, "server_error")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIApi:
    def __init__(self, answerer, config: settings.Settings):
        self.answerer, self.config = answerer, config
        self.keys = [k for k in [config.api_key, *(f"{u}:{p}" for u, p in settings.credentials(config.auth))] if k]

    @property
    def model(self) -> str:
        """The served model's name: a local folder's name, never the server's path to it."""
        model_id = self.answerer.engine.model_id
        return Path(model_id).name if Path(model_id).is_absolute() else model_id

    def authorize(self, request: Request) -> dict:
        """With --api-key or --auth, a key is required: the API is never less guarded than the page.

        Returns answer()'s client and priority: a key holds one place in the line, as a browser tab does, and an
        --auth user's key has that user's priority. Without keys, API clients cannot be told apart and are not held
        to one place.
        """
        if not self.keys:
            return {"client": None, "priority": 0}
        key = doors.matching(doors.sent(request.headers), self.keys)
        if key is None:
            raise Refused(401, "api_key")
        user = None if key == self.config.api_key else key.partition(":")[0]
        return {"client": "key:" + key, "priority": int(user in self.answerer.priority_users)}

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except Refused as e:
            return failure(texts.language(request), e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "qvl"}]})

    async def image(self, part, field: str) -> bytes:
        url = part.get("url") if isinstance(part, dict) else part
        if not isinstance(url, str):
            raise InputError("bad_field", field=field)
        return await links.read(url, field, self.config.allow_image_urls, self.answerer.upload_limit)

    async def conversation(self, messages) -> list[dict]:
        """messages -> the page's conversation entries; a message's images go before its text, as on the page."""
        if not isinstance(messages, list) or not messages:
            raise InputError("bad_field", field="messages")
        entries = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise InputError("bad_field", field=where)
            content, words, pictures = message.get("content"), [], []
            if isinstance(content, str):
                words.append(content)
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        words.append(part["text"])
                    elif kind == "image_url":
                        pictures.append(await self.image(part.get("image_url"), f"{where}.content[{j}].image_url"))
                    else:
                        raise InputError("bad_field", field=f"{where}.content[{j}]")
            elif content is not None:
                raise InputError("bad_field", field=f"{where}.content")
            role = {"developer": "system"}.get(message.get("role"), message.get("role"))  # OpenAI's newer name
            entries.append({"role": str(role), "text": "\n".join(words), "images": pictures})
        return entries

    def params(self, body: dict):
        """GenParams from the request's OpenAI fields; the server's flags for what it leaves out."""
        tokens = _number(body, "max_completion_tokens", int, 1, 1 << 20) or _number(body, "max_tokens", int, 1, 1 << 20)
        temperature = _number(body, "temperature", float, 0, 2)
        greedy = None if temperature is None else temperature == 0  # OpenAI's way of asking for greedy decoding
        values = dict(max_new_tokens=tokens, temperature=temperature or None, top_p=_number(body, "top_p", float, 1e-9, 1),
                      top_k=_number(body, "top_k", int, 1, 1 << 20), greedy=greedy,
                      seed=_number(body, "seed", int, 0, 2 ** 63 - 1))
        if body.get("n") not in (None, 1):  # one answer per request
            raise InputError("bad_field", field="n")
        return self.answerer.params(values)

    @staticmethod
    def stops(body: dict) -> list[str]:
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise InputError("bad_field", field="stop")
        return stops

    async def completions(self, request: Request) -> Response:
        lang, updates = texts.language(request), None
        try:
            who = self.authorize(request)
            try:
                body = await request.json()
            except ValueError:
                raise InputError("bad_field", field="body") from None
            if not isinstance(body, dict):
                raise InputError("bad_field", field="body")
            params, stops, stream = self.params(body), self.stops(body), body.get("stream") is True
            turns = answers.turns(await self.conversation(body.get("messages")))
            if (now := self.answerer.engine.progress()) is not None:
                raise Refused(503, "not_ready", now)
            updates = self.answerer.answer(turns, params, use_cache=True, fresh=False, **who)
            first = await self.opening(updates, request)
        except Exception as e:
            if updates is not None:
                await updates.aclose()
            return failure(lang, e)
        if first is None:  # the client left while waiting
            await updates.aclose()
            return Response(status_code=499)
        reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model}
        pieces = self.pieces(first, updates, stops)
        if stream:
            wants_usage = (body.get("stream_options") or {}).get("include_usage") is True
            return StreamingResponse(self.events(reply, pieces, updates, lang, wants_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.whole(reply, pieces, updates, lang, request)

    @staticmethod
    async def opening(updates, request: Request):
        """The first update past the wait in line (None if the client left meanwhile): an error before it, a bad
        image or a conversation over the limit, is still an HTTP status."""
        async for update in updates:
            if not update.ahead or update.stats is not None:
                return update
            if await request.is_disconnected():
                return None
        raise RuntimeError("the answer ended without its stats")

    @staticmethod
    async def pieces(update, updates, stops: list[str]):
        """(delta, None) as the answer grows, its new reasoning ({"reasoning_content": …}) or its new text
        ({"content": …}), then ({}, (finish_reason, stats)); stats is None when a stop sequence ended it early (the
        answer is closed there, so the rest is never generated). Stop sequences end the answer, not the reasoning."""
        sent = thought = ""
        while True:
            final = update.stats is not None
            if len(update.reasoning or "") > len(thought):
                yield {"reasoning_content": update.reasoning[len(thought):]}, None
                thought = update.reasoning
            shown, hit = cut(update.text, stops, final)
            if len(shown) > len(sent):
                yield {"content": shown[len(sent):]}, None
                sent = shown
            if hit or final:
                truncated = not hit and update.stats.get("truncated")
                yield {}, ("length" if truncated else "stop", None if hit else update)
                return
            update = await anext(updates)

    async def whole(self, reply: dict, pieces, updates, lang: str, request: Request) -> Response:
        message = {"role": "assistant", "content": ""}
        async with contextlib.aclosing(updates):
            try:
                async for delta, end in pieces:
                    for field, piece in delta.items():
                        message[field] = message.get(field, "") + piece
                    if end is None and await request.is_disconnected():
                        return Response(status_code=499)  # leaving the block frees the engine
            except Exception as e:
                return failure(lang, e)
        reason, last = end
        return JSONResponse({
            **reply, "object": "chat.completion", "usage": usage(last and last.stats),
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "qvl_status": status_line(lang, last)})

    async def events(self, reply: dict, pieces, updates, lang: str, wants_usage: bool):
        """Server-sent events in OpenAI's chunk format, ending `data: [DONE]`. A client that leaves cancels this
        generator (Starlette watches for it), which closes the answer and frees the engine."""
        head = {**reply, "object": "chat.completion.chunk"}

        def chunk(delta: dict, reason: str | None = None) -> str:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]})

        async with contextlib.aclosing(updates):
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for delta, end in pieces:
                    if delta:
                        yield chunk(delta)
            except Exception as e:  # after the status line went out: the error is an event, as OpenAI sends it
                yield sse(json.loads(failure(lang, e).body))
                return
            reason, last = end
            yield sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reason, "logprobs": None}],
                       "qvl_status": status_line(lang, last)})
            if wants_usage:
                yield sse({**head, "choices": [], "usage": usage(last and last.stats)})
            yield sse("[DONE]")


def routes(answerer, config: settings.Settings) -> list[Route]:
    """The API's routes, for Gradio's FastAPI app (launch's app_kwargs={"routes": …}, so they come before its own)."""
    api = OpenAIApi(answerer, config)
    return [Route("/v1/chat/completions", api.completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"])]
