"""CPU facts a run states at start-up: torch threads per rank, and whether bf16 is native."""

from __future__ import annotations

import os

import torch

from megapost.runtime.placement import cuda_pci_addresses, gpu_threads, place_gpu_rank
from megapost.utils.machine import load_average, local_ranks, usable_cores

__all__ = ["bf16_note", "cpu_flags", "local_ranks", "native_bf16", "set_threads"]

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The ``flags`` of the first CPU in ``path`` (empty when unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def bf16_note(bf16: bool, device: torch.device, flags: set[str] | None = None) -> str | None:
    """One line for a bf16 run on a CPU without AVX-512-BF16/AMX (emulated bf16 is ~10x slower)."""
    if not bf16 or device.type != "cpu":
        return None
    flags = cpu_flags() if flags is None else flags
    if not flags or native_bf16(flags):
        return None
    return ("bf16 on this CPU (no avx512_bf16/amx_bf16 in /proc/cpuinfo) is emulated: expect ~10x slower "
            "steps than fp32; pass --no-bf16 (or --fp32) to train in fp32")


def set_threads(gpu: bool | None = None, sys_root: str = "/sys") -> str:
    """Torch threads per rank: OMP_NUM_THREADS when set, else on a GPU rank (``gpu``, default: CUDA is
    available) 2-4 after binding the rank to its share of its GPU's NUMA node (megapost.runtime.placement),
    else the cores not kept busy by other processes (usable cores minus the 1-minute load average beyond
    this job's ranks, at least 1) divided among the local ranks, at least 1; returns the start-line text."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if gpu:
        return _gpu_threads(sys_root)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return f"threads {torch.get_num_threads()}/rank (OMP_NUM_THREADS)"
    cores, ranks = usable_cores(), local_ranks()
    others = max(0.0, load_average() - ranks)  # this job's ranks are starting: not counted as others
    free = max(1, int(cores - others + 0.5))
    threads = max(1, min(cores, free) // ranks)
    torch.set_num_threads(threads)
    return (f"threads {threads}/rank ({cores} cores, {free} free at load {load_average():.1f}, / {ranks} "
            "local ranks; OMP_NUM_THREADS to set)")


def _gpu_threads(sys_root: str) -> str:
    """``set_threads`` on a GPU rank: bind, then 2-4 threads (OMP_NUM_THREADS wins)."""
    ranks = local_ranks()
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    cores, where = place_gpu_rank(local, ranks, cuda_pci_addresses(), sys_root)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return f"threads {torch.get_num_threads()}/rank (OMP_NUM_THREADS); {where}"
    threads = gpu_threads(len(cores) if cores else usable_cores() // ranks)
    torch.set_num_threads(threads)
    return f"threads {threads}/rank (GPU rank: 2-4; OMP_NUM_THREADS to set); {where}"
