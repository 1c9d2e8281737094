"""What CPU this process really runs on: usable cores and the instruction sets that pick kernels."""
import os
import platform
from functools import cache
from pathlib import Path

# cpuinfo flag -> the name users know it by, in the order the settings tab shows them.
_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16", "amx_tile": "AMX"}


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


@cache
def flags() -> frozenset[str]:
    """Instruction-set names from _FLAGS that this CPU has (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return frozenset(name for flag, name in _FLAGS.items() if flag in have)


@cache
def model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """One line for logs and the settings tab, e.g. 'AMD EPYC, 2 cores, AVX2 AVX-512 VNNI BF16'."""
    have = [name for name in _FLAGS.values() if name in flags()]
    return f"{model_name()}, {available_cores()} cores, {' '.join(have) or 'no AVX2'}"
