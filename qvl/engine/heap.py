"""glibc's heap in a long-running server: few arenas, and freed memory handed back, so the resident size stays flat."""
import ctypes

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc (macOS, musl): another allocator, nothing to tune
    _LIBC = None
_M_ARENA_MAX = -8  # malloc.h


def limit_arenas(count: int = 2):
    """At most `count` malloc arenas. glibc gives threads that contend their own arena (up to 8 per core) and reuses a
    freed block only in its own arena; with the event loop's, Gradio's and torch's threads, a tiny-model soak's RSS
    rose 53 MB over 1500 requests with the default and 16 MB over 1000 with 2. Takes effect for arenas made later, so
    call it before the threads start."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, count)


def trim():
    """Hand freed heap memory back to the OS. glibc keeps freed blocks under its (grown) mmap threshold in its heap:
    the freed bf16 layers added about 1 GB to the resident size of a 2B load, and each request's tensors (pixels,
    KV cache) would otherwise ratchet a long-running server's memory up."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
