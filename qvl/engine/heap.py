"""glibc's heap in a long-running server: one arena; the model's weights, and what lives through many requests, in
pages of their own outside it, on huge pages once loaded; what a request frees kept for the next while requests come,
and handed back once they stop or once it has piled up (the engine's HELD_MAX). So a busy server grows little, and an
idle one drops back."""
import ctypes
import math
import mmap

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc (macOS, musl): another allocator, nothing to tune
    _LIBC = None
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # malloc.h
_MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1); Python's mmap names it from 3.14 only
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _huge_page_size() -> int:
    """The kernel's transparent huge page (2 MB on x86-64), or 0 where it has none (not Linux, THP off)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as enabled:
            if "[never]" in enabled.read():
                return 0
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as size:
            return int(size.read())
    except (OSError, ValueError):
        return 0


HUGE = _huge_page_size()


def limit_arenas(count: int = 1):
    """At most `count` malloc arenas; call it before any thread starts, since glibc fixes the limit at a second
    thread's first allocation. By default glibc gives threads that contend their own arena (up to 8 per core) and
    reuses a freed block only in its own arena: with the event loop's, Gradio's and torch's threads, a tiny-model
    soak's RSS rose 53 MB over 1500 requests, 16 MB over 1000 with 2 arenas. One: another arena's heap is unmapped
    once emptied, whatever hold_freed() says, so a request in a worker thread faulted its tensors' pages in afresh
    each time; four 2B answers decoded together ended 21.5-22.4 s after they came with one arena, 22.3-22.9 s with two
    and 24.1-24.5 s with glibc's default on an AMX Xeon (docs/performance.md, "Figures behind the code")."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, count)


def map_apart():
    """Until hold_freed(): each block of a megabyte or more in pages of its own, handed back when freed. A load
    allocates the model's weights amid the blocks that converting and packing them free, and in the heap those left
    ~2 GB of holes among the 2B's weights that a server's requests then filled and kept (hold_freed): through a
    200-request soak with --batch 4 the busy server's resident size grew by 1.23 GB, by 0.64 with the weights apart
    (docs/memory-and-caches.md, "Memory over time"). Call it before the load: glibc's own threshold rises to 32 MB as
    blocks are freed, and most of a load's blocks would then land in the heap."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def hold_freed():
    """Keep the blocks that a request frees in the heap, for the next request's tensors, until trim(). By default
    glibc maps a large block afresh for each allocation and hands freed memory at the heap's top back as it is freed,
    so each request faulted its tensors' pages in again: ~120k faults (~470 MB) for the 2B's standard request, 0.13 s
    of its 2.5 s first token on an AMX Xeon (docs/performance.md, "Figures behind the code"). Blocks above 32 MB,
    glibc's largest threshold, are still mapped and unmapped each time."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # set, it no longer adapts to the blocks freed
        _LIBC.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)  # trim() alone hands memory back


def trim():
    """Hand freed heap memory back to the OS. glibc keeps freed blocks under its (grown) mmap threshold in its heap:
    the freed bf16 layers added about 1 GB to the resident size of a 2B load, and each request's tensors (pixels,
    KV cache) would otherwise ratchet a long-running server's memory up."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def resident() -> int:
    """This process's resident bytes; 0 where /proc is not (macOS, Windows)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


def mapped(shape: tuple[int, ...], dtype):
    """An uninitialised tensor in pages mapped for it alone, outside malloc's heap: resident only where written, and
    handed back to the OS whole once it and every view of it are freed. For what lives through many requests'
    short-lived tensors (a conversation's keys and values, an image's kept features): in the heap that hold_freed()
    keeps, each pinned the freed memory around it (docs/memory-and-caches.md, "Memory over time")."""
    import torch  # here, so that app.py reads this module before torch loads

    count = math.prod(shape)
    # Private, as malloc's own mappings are (Python's default is shared); Windows' mmap has neither flag.
    flags = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize), **flags)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def huge_pages(address: int, size: int) -> int:
    """Move the whole huge pages' spans inside [address, address + size) to huge pages now (a copy); the bytes moved,
    0 where the kernel cannot (before Linux 6.1, THP off, not Linux). The edges stay: they belong to other memory."""
    if _LIBC is None or not HUGE:
        return 0
    first, last = -(-address // HUGE) * HUGE, (address + size) // HUGE * HUGE
    if last <= first:
        return 0
    return last - first if _LIBC.madvise(first, last - first, _MADV_COLLAPSE) == 0 else 0


def huge_pages_for_resident(go_on=lambda: True) -> int:
    """Move each huge page's span of this process's anonymous memory that is wholly resident now to a huge page, while
    go_on() says so; the bytes moved. Called once the model is loaded, that is its weights, however the kernels packed
    them (fbgemm's packed weights tell no address): on 4 KB pages a decode step's stream of weights walks the page
    tables every 4 KB, and the 2B's step took 79.5 ms on them against 76.5 on huge pages (w8a14 on an AMX Xeon;
    docs/performance.md, "Figures behind the code"). Wholly resident only, so that no page is added: what a mapping
    has not touched (a thread's stack, a KV buffer's room) stays unallocated."""
    if _LIBC is None or not HUGE:
        return 0
    moved, per = 0, HUGE // mmap.PAGESIZE
    for start, end in _anonymous():
        resident = (ctypes.c_ubyte * ((end - start) // mmap.PAGESIZE))()
        if _LIBC.mincore(start, end - start, resident) != 0:
            continue  # unmapped since /proc was read
        resident = bytes(resident)
        for first in range(-(-start // HUGE) * HUGE, end - HUGE + 1, HUGE):
            if not go_on():
                return moved
            page = (first - start) // mmap.PAGESIZE
            if b"\0" not in resident[page:page + per]:
                moved += huge_pages(first, HUGE)
    return moved


def _anonymous() -> list[tuple[int, int]]:
    """This process's private, writable mappings of no file of at least one huge page: malloc's blocks of its own."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        span, perms, _, _, inode, *name = line.split()
        start, end = (int(a, 16) for a in span.split("-"))
        if perms == "rw-p" and inode == "0" and not name and end - start >= HUGE:
            found.append((start, end))
    return found
