"""A remote engine: any OpenAI-compatible server (vLLM, SGLang, llama-server, another qvl) answers instead of a
model loaded here (`--backend URL`). It has the local Engine's interface, so the page, `ask`, the OpenAI API, the
answer cache and the line cannot tell them apart; it never imports torch.

What the user is told when the backend fails (unreachable, too slow, the stream cut mid-answer, a refusal) is an
EngineError or an InputError naming the message; nothing is cached then (the Answerer caches only a finished
answer), and the next request tries the backend again.
"""
import base64
import io
import json
import logging
import threading
import time

import httpx

from qvl import conversation, images, video
from qvl.conversation import THINK, THOUGHT, EngineError, Stats, Turn
from qvl.images import InputError
from qvl.settings import GenParams, Settings

log = logging.getLogger("qvl")


class RemoteEngine:
    """The backend at settings.backend; attributes model_id, precision, identity, fallback, ready as Engine's."""

    fallback = None  # nothing is loaded here, so nothing falls back
    threads = 1  # no model computes here; the backend's threads are its own (Settings shows them read as 1)

    def __init__(self, settings: Settings):
        self.settings, self.url = settings, settings.backend.rstrip("/")
        self.precision = f"remote: {self.url}"  # a visitor reads only "remote"; the operator sees where
        headers = {"Authorization": f"Bearer {settings.backend_key}"} if settings.backend_key else {}
        self.http = httpx.Client(headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(settings.backend_timeout, connect=10.0))
        self.model = settings.backend_model
        self.ready = threading.Event()
        log.info("backend %s, model %s", self.url, self.model or "not known yet (asked at warm-up)")

    @property
    def model_id(self) -> str:
        return self.model or "?"

    @property
    def identity(self) -> str:
        """Part of every answer-cache key: the backend's model and where it is served."""
        return f"{self.model_id}@{self.url}"

    def set_threads(self, n: int):
        """Nothing computes here: the backend's threads are set where it runs."""

    def memory_info(self) -> dict:
        """The backend keeps its own conversations (a qvl backend reports reuse in its stats): none are kept here."""
        return {"conversations": None, "features": None}

    def forget(self):
        """Nothing is kept here to forget."""

    def close(self) -> bool:
        """At exit: the connections to the backend."""
        self.http.close()
        return True

    def warm_up(self, pictures: list, question: str):
        """Learn the backend's model name if it was not given; then ready, even if the backend is down (each request
        tries again and says so)."""
        try:
            self._resolve()
        except EngineError as e:
            log.warning("backend %s: %s; requests will try again", self.url, e)
        finally:
            self.ready.set()

    def progress(self) -> tuple[str, float | None] | None:
        """As Engine's: ("connecting", None) until warm_up() has asked the backend, then None."""
        return None if self.ready.is_set() else ("connecting", None)

    def _resolve(self):
        """Ask the backend for its model's name, if not known yet (warm-up, or the first request after a failed one)."""
        if self.model is None:
            models = self._call(lambda: self.http.get(self.url + "/models"))
            try:
                self.model = models.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise EngineError("backend_failed", "no model listed", status=models.status_code) from None
            log.info("backend %s serves %s", self.url, self.model)

    def _call(self, send) -> httpx.Response:
        """send() -> its response, 200 or one of the errors the user reads."""
        try:
            response = send()
        except httpx.ConnectError as e:
            raise EngineError("backend_unreachable", str(e)) from None
        except httpx.TimeoutException as e:
            raise EngineError("backend_timeout", str(e)) from None
        except httpx.HTTPError as e:
            raise EngineError("backend_cut", f"{type(e).__name__}: {e}") from None
        if response.status_code != 200:
            response.read()  # a streamed response's error body, for its message
            response.close()
            raise refusal(response)
        return response

    def messages(self, turns: list[Turn], params: GenParams) -> tuple[list[dict], int]:
        """OpenAI messages, each image fitted to the token budget here (the backend gets what the local engine would
        see) and sent as a PNG data: URL; and the image tokens they cost."""
        out, image_tokens = [], 0
        for turn in images.opened(turns, params):  # a PDF as its pages
            content = []
            for source in turn.images:
                # A video goes as its sampled frames with their times: OpenAI-compatible servers differ in whether
                # and how they take video, and every one takes images.
                if isinstance(source, video.Clip):
                    times = ", ".join(f"{i / source.fps:.1f} s" for i in source.indices)
                    content.append({"type": "text", "text": f"(The next {len(source.frames)} images are frames of "
                                                             f"one video, at {times}.)"})
                for frame in source.frames if isinstance(source, video.Clip) else [images.open(source).image]:
                    picture = images.prepare(frame, params.max_image_tokens, params.min_image_tokens)
                    image_tokens += images.tokens(picture)
                    png = io.BytesIO()
                    picture.save(png, "PNG")
                    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
                    content.append({"type": "image_url", "image_url": {"url": url}})
            content.append({"type": "text", "text": turn.text})
            out.append({"role": turn.role, "content": content})
        return out, image_tokens

    def chat(self, turns: list[Turn], params: GenParams | None = None):
        """Answer the conversation through the backend: yield text pieces as they stream in, then one Stats. A
        Thinking model's reasoning, which the backend sends apart (reasoning_content), comes in the local engine's
        tags: THINK, the reasoning, THOUGHT, then the answer.

        Closing this generator (Stop, a client gone) closes the stream from the backend, which ends its work there.
        """
        params = params or self.settings.gen
        start = time.perf_counter()
        conversation.check(turns)
        messages, image_tokens = self.messages(turns, params)
        self._resolve()
        body = {"model": self.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": params.max_new_tokens, "seed": params.seed}
        body.update({"temperature": 0} if params.greedy else
                    {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k})
        pieces, first, finish, usage, done = 0, None, None, {}, False
        thinking, thought = False, None  # the backend sent reasoning; when its answer began
        request = self.http.build_request("POST", self.url + "/chat/completions", json=body)
        response = self._call(lambda: self.http.send(request, stream=True))
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:  # an error after the stream began, as OpenAI sends one
                    raise EngineError("backend_refused", str(event["error"]),
                                      message=event["error"].get("message", ""))
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    delta, text = choice.get("delta") or {}, ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning")  # vLLM's and others' names
                    if reasoning and thought is None:
                        text, thinking = ("" if thinking else THINK + "\n") + reasoning, True
                    if delta.get("content") and thinking and thought is None:
                        text, thought = text + f"\n{THOUGHT}\n\n", time.perf_counter()
                    text += delta.get("content") or ""
                    if text:
                        first, pieces = first or time.perf_counter(), pieces + 1
                        yield text
        except httpx.TimeoutException as e:
            raise EngineError("backend_timeout", str(e)) from None
        except (httpx.HTTPError, ValueError) as e:  # the connection dropped, or a broken event
            raise EngineError("backend_cut", f"{type(e).__name__}: {e}") from None
        finally:
            response.close()
        if not done:
            raise EngineError("backend_cut", "the stream ended without [DONE]")
        end = time.perf_counter()
        first = first or end
        new_tokens = usage.get("completion_tokens", pieces)
        yield Stats(
            prompt_tokens=usage.get("prompt_tokens", 0), image_tokens=image_tokens, new_tokens=new_tokens,
            ttft_s=first - start, decode_tok_s=(new_tokens - 1) / (end - first) if new_tokens > 1 and end > first else 0.0,
            total_s=end - start, stopped=False, truncated=finish == "length",  # a stopped answer is closed first
            reused_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            thinking_s=(thought or end) - start if thinking else 0.0)


def refusal(response: httpx.Response) -> Exception:
    """What to tell the user about a backend's error status: its own message for a request it refuses (a qvl backend
    words it as the page does), busy for 429 and 503, the status otherwise."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    if response.status_code in (429, 503):
        return EngineError("backend_busy", f"{response.status_code}: {message}")
    if response.status_code in (400, 413, 422):
        return InputError("backend_refused", detail=f"{response.status_code}", message=message)
    return EngineError("backend_failed", f"{response.status_code}: {message}", status=response.status_code)
