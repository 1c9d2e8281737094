"""Sizes in bytes: what "500MB", "2GB" or "auto" mean wherever a size is set (caches, memory, uploads)."""
import os
import re
import shutil

_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}  # binary, as Gradio's sizes


def parse_size(text) -> int:
    """Bytes from "500MB", "2GB", "1.5gb", "4096" or an int; units are powers of 1024 (KiB spellings accepted)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text).lower())
    if not match:
        raise ValueError(f"size {text!r} not understood; write a number with an optional unit, e.g. 500MB or 2GB")
    return int(float(match[1]) * _UNITS[(match[2] or "").replace("i", "")])


def auto_size(directory: str) -> int:
    """5% of the free disk where the cache lives, at most 2 GiB: a full laptop disk gets a small cache."""
    existing = directory
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        return min(2 << 30, max(16 << 20, shutil.disk_usage(existing).free // 20))
    except OSError:
        return 2 << 30
