"""What every engine takes and gives, the local one (qvl.engine.local) and a remote one (qvl.engine.remote) alike:
Turns in, text pieces then one Stats out, and the errors either may raise. Light: the page imports it, and a server
fronting a remote engine never loads torch."""
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from qvl import texts

# An answer's text holds a Thinking model's reasoning between these, before the answer (qvl.serve.thinking splits it).
THINK, THOUGHT = "<think>", "</think>"


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"; "system" as the first turn
    text: str = ""
    images: tuple = ()  # images.Picture (decoded once, hashed once), paths, bytes or PIL images, shown before the text


@dataclass(frozen=True)
class Stats:
    prompt_tokens: int
    image_tokens: int
    new_tokens: int
    ttft_s: float  # from the request to the first answer token, image preprocessing included
    decode_tok_s: float
    total_s: float
    stopped: bool  # ended by stop(), not by the model or the token cap
    truncated: bool = False  # ended by the max-new-tokens cap
    reused_tokens: int = 0  # prompt tokens whose KV came from a kept conversation, not prefilled
    cached_images: int = 0  # images whose vision features came from the feature store, not the vision tower
    video_frames: int = 0  # frames sampled from the videos (their tokens are in image_tokens too)
    video_tokens: int = 0
    thinking_s: float = 0.0  # from the request to the end of a Thinking model's reasoning; 0 for other models
    batch: int = 1  # the most answers decoded together in one of its steps (--batch); 1 when it ran alone


class InputError(ValueError):
    """A request the user can fix: the message (a key of texts.TEXT) says how, in the user's language.

    A parameter may be a function of the language (a phrase inside the message); `detail` is the library's own
    wording, for the log only. str() is the English message.
    """

    def __init__(self, key: str, detail: str | None = None, **params):
        self.key, self.detail, self.params = key, detail, params
        super().__init__(self.say("en"))

    def say(self, lang: str) -> str:
        return texts.say(lang, self.key, **{k: v(lang) if callable(v) else v for k, v in self.params.items()})


class EngineError(RuntimeError):
    """No answer, through no fault of the user's (the model server is unreachable, timed out, cut the answer):
    `key` names the message in texts.TEXT; the server keeps serving and the user may retry."""

    def __init__(self, key: str, detail: str = "", **params):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail, self.params = key, detail, params


@runtime_checkable
class Engine(Protocol):
    """What the serving side asks of an engine; qvl.engine.local.Engine and qvl.engine.remote.RemoteEngine are two."""

    model_id: str  # what the page and /v1/models name
    identity: str  # part of every answer-cache key: whatever changes answers (weights, precision, backend)
    precision: str  # how the weights compute, for the page's facts
    threads: int
    fallback: str | None  # why a stand-in model serves instead of the one asked for, else None
    ready: threading.Event  # set once warm_up() is done: requests before it wait

    def chat(self, turns: list[Turn], params=None) -> Iterator[str | Stats]:
        """Text pieces as they come, then one Stats; closing the iterator stops generation within one step. The text
        of a Thinking model's answer starts with THINK, and its reasoning ends at THOUGHT. Raises InputError for what
        the user can fix, EngineError for what they cannot."""

    def warm_up(self, pictures: list, question: str):
        """Make the first answer fast, then set ready (even on failure)."""

    def progress(self) -> tuple[str, float | None] | None:
        """Until ready: the phase of the start and how far it is (0-1, or None if unknown); then None."""

    def set_threads(self, n: int):
        """Threads for the next generations."""

    def memory_info(self) -> dict:
        """What is kept for reuse: {"conversations": ..., "features": ...}, None for what is not kept."""

    def forget(self):
        """Drop whatever is kept for reuse."""

    def close(self) -> bool:
        """At exit: release what the engine holds; False if it could not finish in time."""


def check(turns: list[Turn]):
    """Refuse a conversation no engine can answer, before any work: an unknown role, no question at the end."""
    for i, turn in enumerate(turns):
        # Qwen's chat template takes a system message only first, and text only.
        if turn.role not in ("user", "assistant") and not (turn.role == "system" and i == 0 and not turn.images):
            raise InputError("bad_role", role=turn.role)
    if not turns or turns[-1].role != "user":
        raise InputError("ends_with_user")
    if not turns[-1].text.strip() and not turns[-1].images:
        raise InputError("empty_question")
