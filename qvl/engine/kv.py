"""Conversation memory: the KV caches of recent conversations, so a request prefills only what none of them holds.

A follow-up, Regenerate, Undo and a new question about an image seen before all begin with tokens some earlier
request already ran through the model. After each answer its cache (prompt + the answer tokens fed back) is kept
with its content: one item per cached position, the token id, or for an image's placeholder tokens that image's
identity (its pixels' digest with the token budgets that size it), so two different images of one size never match.
A request is matched by content, never by session, to the entry with the longest common prefix.

An entry is never cut for a request that shares only part of it: the prefix is copied out, and the entry stays for
its own conversation. An entry that the request contains whole is handed over instead of copied; the answer's
entry will hold all of it. Memory is bounded in bytes, least recently used out; the caches being generated into
(one per answer decoding, several with --batch) are reserved for before generation starts, so the bound covers them
too.
"""
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from qvl.sizes import parse_size


def auto_limit(cgroup: str = "/sys/fs/cgroup/memory.max") -> int:
    """An eighth of the memory this process may use (the machine's, or less under a cgroup limit), at most 4 GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        total = min(total, int(open(cgroup).read()))
    except (OSError, ValueError):  # no cgroup v2 limit ("max") or no such file
        pass
    return min(4 << 30, total // 8)


def parse_limit(text: str) -> int:
    return auto_limit() if text == "auto" else parse_size(text)


def content(ids: list[int], placeholders: tuple[int, ...], images: list[tuple[str, int]]) -> tuple:
    """ids with each image's placeholder tokens (an image's or a video's) replaced by its identity; images: (identity,
    token count) in order, a video's frame pairs each one."""
    out, queue, left, identity = [], iter(images), 0, None
    for token in ids:
        if token in placeholders:
            if not left:
                identity, left = next(queue)
            out.append(identity)
            left -= 1
        else:
            out.append(token)
    return tuple(out)


def images_in(items: tuple) -> int:
    """How many images begin among items (a content prefix)."""
    return sum(isinstance(item, str) and (i == 0 or items[i - 1] != item) for i, item in enumerate(items))


def common_prefix(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def nbytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _prefix_copy(cache: DynamicCache, n: int) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :n], layer.values[:, :, :n], i)  # update concatenates: a copy, not a view
    return out


@dataclass
class Entry:
    content: tuple
    cache: DynamicCache
    nbytes: int


class Store:
    """Kept caches, bounded to limit bytes; matched by content. Safe to call from several threads."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0  # bytes held by entries
        self.reserved = 0  # bytes of the caches being generated into
        self.hits = self.misses = self.reused_tokens = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()

    def take(self, request: tuple) -> tuple[DynamicCache | None, int]:
        """A cache holding the first n positions of request, and n (0 and None when nothing matches).

        n leaves at least the last position to prefill (its logits pick the first answer token) and never ends
        inside an image, whose features reach the model only as a whole.
        """
        with self._lock:
            best, n = None, 0
            for key, entry in self._entries.items():  # ties go to the most recently used, which comes later
                length = min(common_prefix(entry.content, request), len(request) - 1)
                while length and isinstance(request[length - 1], str) and request[length] == request[length - 1]:
                    length -= 1  # back to the start of the image it would split
                if length and length >= n:
                    best, n = key, length
            if best is None:
                self.misses += 1
                return None, 0
            self.hits += 1
            self.reused_tokens += n
            entry = self._entries[best]
            if n == len(entry.content):  # the request contains it whole: the answer's entry will subsume it
                del self._entries[best]
                self.used -= entry.nbytes
                return entry.cache, n
            self._entries.move_to_end(best)
        return _prefix_copy(entry.cache, n), n

    def reserve(self, size: int) -> None:
        """Make room for a cache of size bytes about to be generated, beside those already reserved, evicting the
        least recently used; release() it once generated."""
        with self._lock:
            self.reserved += size
            self._evict(self.limit - self.reserved)

    def release(self, size: int) -> None:
        """A reserved cache is generated: keep() it, or not, within what the others' reservations leave."""
        with self._lock:
            self.reserved -= size

    def keep(self, kept: tuple, cache: DynamicCache) -> None:
        """Keep cache, whose positions hold kept; entries it contains whole are dropped: it answers all they could."""
        size = nbytes(cache)
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.content == kept[:len(e.content)]]:
                self.used -= self._entries.pop(key).nbytes
            if size > self.limit - self.reserved:
                return
            self._evict(self.limit - self.reserved - size)
            self._entries[self._next] = Entry(kept, cache, size)
            self._next += 1
            self.used += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used = self.hits = self.misses = self.reused_tokens = 0

    def info(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.used, "limit_bytes": self.limit, "hits": self.hits,
                    "misses": self.misses, "reused_tokens": self.reused_tokens}

    def _evict(self, room: int) -> None:
        while self._entries and self.used > room:
            self.used -= self._entries.popitem(last=False)[1].nbytes


def per_token_bytes(model, dtype: str) -> int:
    """What one position of this model's KV cache takes: keys and values for every layer, in dtype (modes.kv)."""
    text = model.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * (4 if dtype == "fp32" else 2)
