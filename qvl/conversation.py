"""What every engine takes and gives, the local one (qvl.engine.local) and a remote one (qvl.engine.remote) alike: Turns in, text
pieces then one Stats out. Light: the page imports it, and a server fronting a remote engine never loads torch."""
from dataclasses import dataclass

from qvl.images import InputError


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"; "system" as the first turn
    text: str = ""
    images: tuple = ()  # paths, bytes or PIL images, shown before the text


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


class EngineError(RuntimeError):
    """No answer, through no fault of the user's (the model server is unreachable, timed out, cut the answer):
    `key` names the message in texts.TEXT; the server keeps serving and the user may retry."""

    def __init__(self, key: str, detail: str = "", **params):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail, self.params = key, detail, params


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
