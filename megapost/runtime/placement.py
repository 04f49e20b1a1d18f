"""Where a GPU rank's threads run: the cores of the NUMA node its GPU hangs off (Linux sysfs), shared
evenly among the node's local ranks on that NUMA node, and 2-4 torch threads per rank (torchtitan and
Megatron's habit: the launch-bound main thread plus a few for host-side ops; more only spin).

sysfs read (``root`` is "/sys" except in tests, which build a fake tree):
``bus/pci/devices/<domain:bus:device.function>/numa_node`` (-1: the platform does not say) and
``devices/system/node/node<N>/cpulist`` ("0-15,64-79").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

GPU_THREADS = (2, 4)  # per GPU rank: at least, at most


def parse_cpulist(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format; empty text -> [])."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def numa_node_of(pci_address: str, root: str = "/sys") -> int | None:
    """The NUMA node of the PCI device at ``pci_address`` ("0000:18:00.0"; None where unknown)."""
    text = _read(os.path.join(root, "bus", "pci", "devices", pci_address.lower(), "numa_node"))
    if text is None or not text.lstrip("-").isdigit() or int(text) < 0:
        return None
    return int(text)


def node_cpus(node: int, root: str = "/sys") -> list[int]:
    text = _read(os.path.join(root, "devices", "system", "node", f"node{node}", "cpulist"))
    return parse_cpulist(text) if text else []


def rank_cores(local_rank: int, gpu_nodes: Sequence[int | None], allowed: set[int],
               root: str = "/sys") -> list[int]:
    """This rank's share of its GPU's NUMA node cores (those it may run on): the node's cores split into
    equal consecutive slices among the local ranks whose GPUs sit on that node, in local-rank order.
    Empty where the platform does not say (no node) or no share is left."""
    node = gpu_nodes[local_rank] if local_rank < len(gpu_nodes) else None
    if node is None:
        return []
    cores = [c for c in node_cpus(node, root) if c in allowed]
    peers = [r for r, n in enumerate(gpu_nodes) if n == node]
    share = len(cores) // len(peers)
    i = peers.index(local_rank)
    return cores[i * share:(i + 1) * share]


def gpu_threads(cores: int) -> int:
    """Torch threads of a GPU rank with ``cores`` cores of its own: 2-4."""
    lo, hi = GPU_THREADS
    return max(lo, min(hi, cores))


def cuda_pci_addresses() -> list[str]:
    """The PCI address of each visible CUDA device, in device order (empty where torch cannot say)."""
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if not all(hasattr(p, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            return []
        out.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return out


def place_gpu_rank(local_rank: int, local_ranks: int, pci: Sequence[str], root: str = "/sys"
                   ) -> tuple[list[int], str]:
    """Bind this process to its share of its GPU's NUMA node (``os.sched_setaffinity``) where sysfs
    says which node; returns (the cores bound, or [] when left alone, and the start-line words)."""
    nodes = [numa_node_of(a, root) for a in pci[:local_ranks]]
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    cores = rank_cores(local_rank, nodes, allowed, root)
    if not cores:
        why = "no NUMA node for the GPU in /sys" if local_rank >= len(nodes) or nodes[local_rank] is None \
            else "no cores of its NUMA node left to this rank"
        return [], f"not bound ({why})"
    os.sched_setaffinity(0, cores)
    return cores, f"bound to cores {_span(cores)} (NUMA node {nodes[local_rank]} of GPU {pci[local_rank]})"


def _span(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], cores[0]
    for a, b in zip(cores, [*cores[1:], None], strict=True):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a != start else f"{a}")
            start = b if b is not None else start
    return ",".join(parts)
