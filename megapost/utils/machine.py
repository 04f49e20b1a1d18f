"""How busy this machine's CPUs are: the cores this process may use, the ranks sharing them, and the
cores other processes keep busy (the 1-minute load average, or /proc/stat over a measured interval)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_ranks() -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE, else 1."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return max(1, int(os.environ[key]))
    return 1


def load_average() -> float:
    """The 1-minute load average (runnable processes; 0 where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _busy_seconds(path: str = "/proc/stat") -> float | None:
    """CPU seconds all cores spent busy since boot (None without /proc/stat)."""
    try:
        with open(path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def others_busy(fn: Callable[[], T]) -> tuple[T, float]:
    """Run ``fn``; returns its result and how many cores other processes kept busy meanwhile (all busy
    CPU time minus this process's, over the wall time; the load average beyond this process's ranks
    where /proc/stat is missing)."""
    before, cpu0, wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
    result = fn()
    after, cpu1, wall1 = _busy_seconds(), time.process_time(), time.perf_counter()
    if before is None or after is None:
        return result, max(0.0, load_average() - local_ranks())
    wall = max(wall1 - wall0, 1e-3)
    return result, max(0.0, ((after - before) - (cpu1 - cpu0)) / wall)
