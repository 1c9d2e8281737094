"""Vision features kept per image, in memory and on disk, so a picture seen before skips the vision tower.

The key is the image's identity, its pixels' digest (images.Picture) with the token budgets that size it, which is
all that decides what the tower is given, and the engine's identity, so another model's features never match.
On disk the store is a DiskStore folder (<cache-dir>/features): the tensors as safetensors bytes behind their
SHA-256, stored raw and never unpickled, shared by processes and kept across restarts. An entry whose digest,
tensor names, shapes or dtype are not what the model would give is a miss: one warning, recomputed, rewritten.
The most recently used features are also kept in memory, up to MEMORY_LIMIT bytes.
"""
import hashlib
import logging
import threading
from collections import OrderedDict

import safetensors.torch
import torch

from qvl.diskstore import DiskStore
from qvl.engine import heap

log = logging.getLogger("qvl")
MEMORY_LIMIT = 256 << 20  # a 300-token image of the 2B model is ~10 MB of fp32 features

Features = tuple[torch.Tensor, list[torch.Tensor]]  # merged image embeddings, then one deepstack tensor per layer


def _encode(features: Features) -> bytes:
    merged, deepstack = features
    payload = safetensors.torch.save({"merged": merged, **{f"deepstack{i}": t for i, t in enumerate(deepstack)}})
    return hashlib.sha256(payload).digest() + payload


def _decode(value, expected: torch.Size, layers: int, dtype: torch.dtype) -> Features:
    """The features in value; ValueError for anything else, however it came to be on disk."""
    if not isinstance(value, bytes) or hashlib.sha256(value[32:]).digest() != value[:32]:
        raise ValueError("checksum mismatch")
    tensors = safetensors.torch.load(value[32:])
    names = ["merged", *(f"deepstack{i}" for i in range(layers))]
    if sorted(tensors) != sorted(names) or any(t.shape != expected or t.dtype != dtype for t in tensors.values()):
        raise ValueError(f"tensors {[(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]} are not the model's")
    return tensors["merged"], [tensors[name] for name in names[1:]]


def _size(features: Features) -> int:
    return sum(t.numel() * t.element_size() for t in (features[0], *features[1]))


def _apart(features: Features) -> Features:
    """A copy in one block of pages of its own (heap.mapped): kept in memory through many requests, in the heap each
    entry would pin the memory their tensors free around it."""
    tensors = [features[0], *features[1]]
    block, at, copies = heap.mapped((sum(t.numel() for t in tensors),), features[0].dtype), 0, []
    for t in tensors:
        copies.append(block[at:at + t.numel()].view(t.shape).copy_(t))
        at += t.numel()
    return copies[0], copies[1:]


class FeatureStore:
    def __init__(self, directory: str, size_limit: int | str):
        self.disk = DiskStore(directory, size_limit, what="image-feature store")
        self.memory_limit = min(MEMORY_LIMIT, self.disk.size_limit)
        self.hits = self.misses = 0
        self._memory: OrderedDict[str, Features] = OrderedDict()  # least recently used first
        self._memory_bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str, expected: torch.Size, layers: int, dtype: torch.dtype) -> Features | None:
        """The features stored under key, if they have the shape (tokens, dim), layer count and dtype expected."""
        with self._lock:
            found = self._memory.get(key)
            if found is not None:
                self._memory.move_to_end(key)
                self.hits += 1
                return found
        value = self.disk.read(key)
        try:
            found = None if value is None else _decode(value, expected, layers, dtype)
        except Exception as e:  # safetensors raises its own error types for damaged bytes
            log.warning("image-feature store: entry %s is damaged (%s); recomputing it", key[:12], e)
            self.disk.delete(key)
        with self._lock:
            self.hits, self.misses = self.hits + (found is not None), self.misses + (found is None)
        if found is not None:
            found = _apart(found)  # out of the bytes read
            self._remember(key, found)
        return found

    def put(self, key: str, features: Features) -> None:
        # A copy: the tower's outputs are views of one tensor for all the images it encoded at once.
        features = _apart(features)
        self._remember(key, features)
        self.disk.write(key, _encode(features))

    def clear(self) -> None:
        """Empty memory and disk; after a disk fault, try the folder again."""
        with self._lock:
            self._memory.clear()
            self._memory_bytes = self.hits = self.misses = 0
        self.disk.clear()

    def info(self) -> dict:
        entries, size = self.disk.volume()
        with self._lock:
            return {"memory_entries": len(self._memory), "memory_bytes": self._memory_bytes,
                    "memory_limit_bytes": self.memory_limit, "disk_entries": entries, "disk_bytes": size,
                    "disk_limit_bytes": self.disk.size_limit, "hits": self.hits, "misses": self.misses,
                    "directory": self.disk.directory, "error": self.disk.error}

    def _remember(self, key: str, features: Features) -> None:
        size = _size(features)
        with self._lock:
            if key in self._memory or size > self.memory_limit:
                return
            while self._memory and self._memory_bytes + size > self.memory_limit:
                self._memory_bytes -= _size(self._memory.popitem(last=False)[1])
            self._memory[key] = features
            self._memory_bytes += size
