"""The inference engine: Qwen3-VL loaded once, answering conversations about images as a text stream."""
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import Qwen3VLProcessor

from qvl import generate, heap, images, quant, texts, tiny
from qvl.images import InputError
from qvl.settings import GenParams, Settings

log = logging.getLogger("qvl")
TINY_DIR = Path(os.path.expanduser("~")) / ".cache" / "qvl" / "tiny-v1"


def _weights_version(model, source: str) -> str:
    """The hub commit when there is one; for a local folder, a hash of each weight file's name, size and ends."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return commit
    digest = hashlib.sha256()
    for path in sorted(Path(source).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}".encode() + f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _local_copy(source: str) -> str:
    """A folder holding the checkpoint: source itself, the hub cache's copy, or a fresh download.

    The hub client retries an unreachable host for minutes; a 3-second probe turns that into an immediate fallback.
    """
    if Path(source).is_dir():
        return source
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(source, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    host = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=3).close()
    except OSError as e:
        raise OSError(f"no local copy, and the hub ({constants.ENDPOINT}) is unreachable: {e}") from None
    log.info("downloading %s from the hub (about 4.5 GB for the 2B model)", source)
    return snapshot_download(source)


class ModelUnavailable(RuntimeError):
    """The real weights could not be loaded and --require-model forbids the tiny fallback."""


class ImageOnlyProcessor(Qwen3VLProcessor):
    # Qwen3VLProcessor also builds a video processor, which needs torchvision; this demo only takes images.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
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


class Engine:
    """Qwen3-VL loaded once; attributes model_id, folder, precision, identity, max_context describe it."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.fallback: str | None = None  # why the tiny model serves instead of the real one
        # The inter-op pool is fixed by torch at its first parallel op, so it is set here, once, before loading.
        if torch.get_num_interop_threads() != self.settings.interop_threads:
            try:
                torch.set_num_interop_threads(self.settings.interop_threads)
            except RuntimeError:
                log.warning("inter-op threads already fixed at %d for this process", torch.get_num_interop_threads())
        self.set_threads(self.settings.threads)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            self._load(self.settings.model)
        except Exception as e:  # hub unreachable, folder missing, wrong checkpoint: all end in the same fallback
            reason = f"could not load {self.settings.model!r}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            if self.settings.require_model:
                raise ModelUnavailable(
                    f"{reason}\nFixes: connect to the internet so the weights can download, download them with "
                    f"`hf download {self.settings.model}`, or pass --model /path/to/local/folder. "
                    "Without --require-model the app serves a tiny offline model instead."
                ) from e
            self.fallback = reason
            log.warning("%s. Serving the TINY OFFLINE MODEL instead: answers will be gibberish.", reason)
            if not (TINY_DIR / "model.safetensors").exists():
                tiny.build(TINY_DIR)
            self._load(str(TINY_DIR))

    def _load(self, source: str):
        self.folder = _local_copy(source)
        self.processor = ImageOnlyProcessor.from_pretrained(self.folder, backend="pil")
        self.model, self.precision = quant.load_model(self.folder, self.settings.quant)
        self.model_id = source
        limit = self.model.config.text_config.max_position_embeddings
        self.max_context = min(self.settings.max_context, limit)
        # What makes this engine's answers what they are; part of every answer-cache key. The context limit is in
        # it because near the limit it shortens the answer.
        self.identity = f"{source}@{_weights_version(self.model, self.folder)}|{self.precision}|ctx{self.max_context}"

    def set_threads(self, n: int):
        """Intra-op threads, applied from the next request on."""
        torch.set_num_threads(max(1, int(n)))

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def stop(self):
        """Stop the running generation within one decode step."""
        self._stop.set()

    def chat(self, turns: list[Turn], params: GenParams | None = None) -> Iterator[str | Stats]:
        """Answer the conversation: yield text pieces as they are generated, then one Stats.

        Raises InputError (before any model compute) for unusable images or a conversation over the context limit.
        """
        params = params or self.settings.gen
        start = time.perf_counter()
        inputs, image_tokens = self._inputs(turns, params)
        prompt_tokens = inputs["input_ids"].shape[1]
        budget = self.max_context - prompt_tokens
        if budget < 1:
            raise self._too_long(prompt_tokens, image_tokens, len([i for t in turns for i in t.images]))
        params = params if params.max_new_tokens <= budget else replace(params, max_new_tokens=budget)
        with self._lock:
            self._stop.clear()
            ids, sent, first = [], "", None
            for token in generate.stream(self.model, inputs, params, self._stop):
                first = first or time.perf_counter()
                ids.append(token)
                text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # hold back a half-decoded UTF-8 character
                    yield text[len(sent):]
                    sent = text
            text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
            if text != sent:
                yield text[len(sent):]
            end = time.perf_counter()
            stopped = self._stop.is_set()
            heap.trim()
        first = first or end
        yield Stats(
            prompt_tokens=prompt_tokens, image_tokens=image_tokens, new_tokens=len(ids),
            ttft_s=first - start, decode_tok_s=(len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0,
            total_s=end - start, stopped=stopped, truncated=not stopped and len(ids) >= params.max_new_tokens,
        )

    def _too_long(self, needed: int, image_tokens: int, pictures: int) -> InputError:
        """The refusal of a conversation over the context limit, naming the model's own limit when it is the lower."""
        return InputError("too_long_model" if self.max_context < self.settings.max_context else "too_long",
                          needed=needed, limit=self.max_context,
                          images=lambda lang: texts.image_share(lang, image_tokens, pictures))

    def _inputs(self, turns: list[Turn], params: GenParams) -> tuple[dict, int]:
        """Tokenize the conversation and preprocess its images, refusing an oversized one before pixel work."""
        messages, pictures = [], []
        for turn in turns:
            if turn.role not in ("user", "assistant"):
                raise InputError("bad_role", role=turn.role)
            content = []
            for source in turn.images:
                pictures.append(images.prepare(images.load(source), params.max_image_tokens, params.min_image_tokens))
                content.append({"type": "image"})
            # JSON escapes such as \ud83d\ude00 reach Python as split or lone surrogates, which the tokenizer refuses:
            # pairs are joined again, a lone one becomes U+FFFD, as a browser would show it.
            text = turn.text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            content.append({"type": "text", "text": text})
            messages.append({"role": turn.role, "content": content})
        if not messages or messages[-1]["role"] != "user":
            raise InputError("ends_with_user")
        if not turns[-1].text.strip() and not turns[-1].images:
            raise InputError("empty_question")
        image_tokens = sum(images.tokens(p) for p in pictures)
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text_tokens = len(self.processor.tokenizer(prompt)["input_ids"]) - len(pictures)
        if text_tokens + image_tokens >= self.max_context:
            raise self._too_long(text_tokens + image_tokens, image_tokens, len(pictures))
        size = {"shortest_edge": params.min_image_tokens * 1024, "longest_edge": params.max_image_tokens * 1024}
        inputs = self.processor(
            text=[prompt], images=pictures or None, return_tensors="pt", images_kwargs={"size": size}
        )
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return dict(inputs), image_tokens
