"""Answers on disk, so a repeated image + question costs milliseconds instead of seconds of CPU.

The key is everything that determines an answer and nothing else: the decoded pixels of each image (after EXIF
orientation and RGB conversion, so re-uploading the same photo, or the same pixels as PNG or lossless WebP, hits;
images.Picture.digest, which the engine's stores key on too),
the whole conversation (roles, texts and where the images are), every GenParams field, and the model's identity
(source, weights version, precision/quantization).

Sampled answers: GenParams.seed is fixed by default, so a sampled answer is a function of the inputs and the seed,
and it is cached like a greedy one; asking again returns the same answer the model would have given. Regenerate in
the UI picks a fresh random seed and bypasses the cache, so it always runs the model.

Only complete answers are stored (never a stopped one, never an empty one; the caller never stores a failed one),
as JSON text: the answer, its Stats and when it was made. Nothing read from the cache directory is ever unpickled.

The directory is a diskcache (SQLite), bounded by size with least-recently-used eviction, kept across restarts and
safe to share between processes. A cache that cannot be used (unwritable, corrupted, deleted and not recreatable)
never breaks answering: one warning is logged, the app answers without it, and info()["error"] says why; clear()
tries it again.
"""
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from qvl import images
from qvl.diskstore import DiskStore

log = logging.getLogger("qvl")


@dataclass(frozen=True)
class Hit:
    text: str
    stats: dict  # the answer's Stats as a plain dict
    created: float  # unix time the answer was generated


class AnswerCache(DiskStore):
    def __init__(self, directory: str, size_limit: int | str = "auto", enabled: bool = True):
        self.hits = self.misses = 0  # since this process started
        super().__init__(directory, size_limit, enabled, what="answer cache")

    def key(self, turns, params, model_identity: str) -> str:
        """The answer's key. Decodes every image not yet a Picture (images.opened spares that), so an unreadable one
        raises images.ImageError, like the engine."""
        conversation = [
            {"role": t.role, "text": t.text, "images": [images.open(s).digest for s in t.images]} for t in turns
        ]
        canonical = json.dumps(
            {"model": model_identity, "params": dataclasses.asdict(params), "turns": conversation},
            sort_keys=True, ensure_ascii=False,
        )
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()  # JSON can carry lone surrogates

    def get(self, key: str) -> Hit | None:
        if self._live() is None:
            return None
        value = self.read(key)
        try:
            record = json.loads(value)
            hit = Hit(text=record["text"], stats=dict(record["stats"]), created=float(record["created"]))
        except (TypeError, ValueError, KeyError):  # absent, or an entry this code did not write
            hit = None
        with self._lock:
            self.hits, self.misses = self.hits + (hit is not None), self.misses + (hit is None)
        return hit

    def put(self, key: str, text: str, stats) -> bool:
        """Store a complete answer; a stopped or empty one is refused (False), as is any write when unusable."""
        if stats.stopped or not text.strip():
            return False
        record = {"text": text, "stats": dataclasses.asdict(stats), "created": time.time()}
        return self.write(key, json.dumps(record))  # ASCII escapes: even a lone surrogate stores and reads back

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self.hits = self.misses = 0

    def info(self) -> dict:
        entries, size = self.volume()
        return {
            "enabled": self.enabled, "entries": entries, "size_bytes": size, "hits": self.hits,
            "misses": self.misses, "directory": self.directory, "error": self.error,
        }

