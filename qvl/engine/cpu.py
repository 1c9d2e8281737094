"""What CPU this process really runs on: usable cores and the instruction sets that pick kernels."""
import ctypes
import gc
import os
import platform
import sys
import threading
from functools import cache
from pathlib import Path

# cpuinfo flag -> the name users know it by, in the order the settings tab shows them: x86's "flags", then Arm's
# "Features" (int8 dot products, int8 matrix multiply, bf16 dot products, scalable vectors).
_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16", "amx_tile": "AMX",
          "asimddp": "DOTPROD", "i8mm": "I8MM", "bf16": "BF16", "sve": "SVE"}
# Arm's (implementer, part) -> core, where /proc/cpuinfo names no model: the cloud's Arm servers (Graviton 2-4, Ampere
# Altra, Google Axion, Azure Cobalt) are these Neoverse cores.
_ARM_CORES = {(0x41, 0xD0C): "Neoverse N1", (0x41, 0xD40): "Neoverse V1", (0x41, 0xD49): "Neoverse N2",
              (0x41, 0xD4F): "Neoverse V2", (0x41, 0xD8E): "Neoverse N3", (0x41, 0xD84): "Neoverse V3"}


def available_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its affinity mask, further capped by a cgroup CPU quota (containers, Spaces)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cores, int(quota)) if quota else cores)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs granted by the cgroup (v2 cpu.max, else v1 cfs quota/period); None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1.0, int(quota) / int(period))


# The OpenMP runtimes whose worker threads a thread may hold: torch's libgomp (by its soname) and the system's, which
# numba's OpenMP layer links by this name once its kernels have run. Found once each is loaded; never loaded here.
_OPENMP_NAMES, _openmp = ("libgomp.so.1", "libgomp.so.1.0.0"), {}


def release_threads():
    """Hand the calling thread's OpenMP worker threads back, in every OpenMP runtime loaded; its next parallel op makes
    them again (~70 us). libgomp gives each thread that runs parallel work a team of its own, and once the teams
    outnumber the cores every team spins only briefly between parallel regions before it sleeps: with an idle team
    kept by another thread, a 2B decode step of four answers took 151-158 ms against 131-138 with one team
    (docs/performance.md, "Figures behind the code"). So a thread that stops computing on the model says so."""
    for name in _OPENMP_NAMES:
        if name not in _openmp and hasattr(os, "RTLD_NOLOAD"):
            try:
                _openmp[name] = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:  # not loaded (yet), or not glibc's OpenMP: another runtime, nothing to hand back
                continue
        if name in _openmp:
            _openmp[name].omp_pause_resource_all(1)  # omp_pause_soft; libgomp frees this thread's teams either way


def use_threads(n: int):
    """torch's intra-op thread count, n, for the calling thread: torch keeps one per thread, which a thread that has
    computed never takes from another thread's set_num_threads, and a server sets it in one thread (the settings
    tab's) and resumes answers in others."""
    import torch  # here: app.py reads this module before torch loads

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def background(lower: int = 10):
    """Lower the calling thread's scheduling priority by `lower` (Linux keeps one per thread), so that work that can
    wait (packing weights, repacking them) gives the cores to the work someone waits for (imports and the page while
    the model loads, a request once it is up). Where threads have no priority of their own, nothing changes."""
    if not (hasattr(os, "setpriority") and platform.system() == "Linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + lower))
    except OSError:
        pass


# While a model loads, the GIL changes hands at this interval instead of Python's 5 ms (SERVING_SWITCH_S, once it is
# ready), so that threads packing weights with it released get it back sooner from the imports and the page
# (docs/performance.md, "Figures behind the code").
LOADING_SWITCH_S, SERVING_SWITCH_S = 0.0005, sys.getswitchinterval()


def hold_collector():
    """At a start, before its imports: no garbage collection until release_collector(). The imports (torch,
    transformers, gradio) leave ~0.5M long-lived objects, and the collector, set off again and again as they pile up,
    traversed them all each time, a fifth of the imports' time (docs/performance.md, "Figures behind the code")."""
    gc.disable()


def release_collector():
    """Once the imports are done: collect once (~0.4 s), keep what survives (modules, classes, functions: the
    process's for good) out of every later collection, where a full one took as long again, and collect as usual."""
    gc.collect()
    gc.freeze()
    gc.enable()


# AMD (family, first model, last model, core): cloud VMs often name the CPU only "AMD EPYC", which covers cores as far
# apart as Zen 1 and Zen 5, and a figure is only comparable with one from the same core.
_AMD_CORES = [(23, 0x08, 0x08, "Zen+"), (23, 0x18, 0x18, "Zen+"), (23, 0x00, 0x2F, "Zen 1"),
              (23, 0x30, 0xFF, "Zen 2"), (25, 0x10, 0x1F, "Zen 4"), (25, 0x60, 0xAF, "Zen 4"),
              (25, 0x00, 0x5F, "Zen 3"), (26, 0x00, 0x7F, "Zen 5")]


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(name: str, text: str) -> str:
    """The first processor's value for name in /proc/cpuinfo's text ("" where missing)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def flags(text: str | None = None) -> frozenset[str]:
    """Instruction-set names from _FLAGS that this CPU has (empty where /proc/cpuinfo is missing)."""
    text = _cpuinfo() if text is None else text
    have = set((_field("flags", text) or _field("Features", text)).split())
    return frozenset(name for flag, name in _FLAGS.items() if flag in have)


def arm(machine: str | None = None) -> bool:
    """Whether this is a 64-bit Arm CPU, where PyTorch has no fbgemm (its int8 kernels are x86's)."""
    return (platform.machine() if machine is None else machine).lower() in ("aarch64", "arm64")


def model_name(text: str | None = None) -> str:
    text = _cpuinfo() if text is None else text
    try:
        part = _ARM_CORES.get((int(_field("CPU implementer", text), 16), int(_field("CPU part", text), 16)))
    except ValueError:
        part = None
    return _field("model name", text) or part or platform.processor() or platform.machine()


def _identity(text: str | None) -> tuple[str, int, int] | None:
    """The first processor's vendor, family and model (None where /proc/cpuinfo lacks the numbers)."""
    text = _cpuinfo() if text is None else text
    try:
        return _field("vendor_id", text), int(_field("cpu family", text)), int(_field("model", text))
    except ValueError:
        return None


def core(text: str | None = None) -> str:
    """AMD's core generation ('Zen 3'), or 'family F model M' for an AMD one this table does not know; '' for
    other vendors, whose model names say it."""
    vendor, family, model = _identity(text) or ("", 0, 0)
    if vendor != "AuthenticAMD":
        return ""
    return next((name for f, first, last, name in _AMD_CORES if f == family and first <= model <= last),
                f"family {family} model {model}")


def halves_256_bit(text: str | None = None) -> bool:
    """Whether this CPU's cores run each 256-bit AVX2 operation as two 128-bit halves: AMD's before Zen 2 (Zen 1,
    Zen+, Hygon's Zen 1, the Bulldozer line) and Intel's Alder Lake-N (N100 to i3-N305: Gracemont cores only, not
    measured here). There fbgemm's int8 kernel is bound by computing, not by reading its weights, so a second decode
    row costs its own time (docs/quantization.md, "What `auto` picks")."""
    vendor, family, model = _identity(text) or ("", 0, 0)
    if vendor == "AuthenticAMD":
        return family < 23 or (family == 23 and model < 0x30)
    return vendor == "HygonGenuine" or (vendor == "GenuineIntel" and family == 6 and model == 0xBE)


def describe() -> str:
    """One line for logs and benchmarks, e.g. 'AMD EPYC (Zen 3), 2 cores, AVX2'."""
    have = list(dict.fromkeys(name for name in _FLAGS.values() if name in flags()))
    name = f"{model_name()} ({core()})" if core() else model_name()
    return f"{name}, {available_cores()} cores, {' '.join(have) or ('NEON' if arm() else 'no AVX2')}"
