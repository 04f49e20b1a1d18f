"""megapost.runtime.placement and the GPU branch of megapost.runtime.cpu.set_threads on fake /sys trees:
which cores a GPU rank is bound to, and 2-4 threads per GPU rank unless OMP_NUM_THREADS says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megapost.runtime import cpu, placement

GPUS = ["0000:18:00.0", "0000:2a:00.0", "0000:9a:00.0", "0000:ab:00.0"]


def fake_sys(root: Path, gpu_nodes: list[int], node_cpus: dict[int, str]) -> str:
    """A /sys with ``GPUS`` on ``gpu_nodes`` and NUMA nodes holding ``node_cpus``."""
    for addr, node in zip(GPUS, gpu_nodes, strict=False):
        d = root / "bus" / "pci" / "devices" / addr
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    for node, cpus in node_cpus.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return str(root)


def test_cpulist_parsing() -> None:
    assert placement.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert placement.parse_cpulist("") == []


def test_ranks_share_their_gpus_numa_node(tmp_path) -> None:
    # two GPUs per socket; node 0 = cores 0-7, node 1 = 8-15: each rank gets 4 cores of its own socket
    root = fake_sys(tmp_path, [0, 0, 1, 1], {0: "0-7", 1: "8-15"})
    nodes = [placement.numa_node_of(a, root) for a in GPUS]
    assert nodes == [0, 0, 1, 1]
    allowed = set(range(16))
    assert [placement.rank_cores(r, nodes, allowed, root) for r in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # only the cores the process may use (a cgroup or Slurm allowing 0-5 and 8-15)
    assert placement.rank_cores(1, nodes, set(range(6)) | set(range(8, 16)), root) == [3, 4, 5]


def test_no_numa_node_leaves_the_rank_alone(tmp_path) -> None:
    root = fake_sys(tmp_path, [-1, -1], {0: "0-7"})
    assert placement.numa_node_of(GPUS[0], root) is None
    assert placement.numa_node_of("0000:ff:00.0", root) is None  # no such device
    cores, text = placement.place_gpu_rank(0, 2, GPUS[:2], root)
    assert cores == [] and "not bound (no NUMA node for the GPU in /sys)" in text


@pytest.mark.parametrize("cores, threads", [(1, 2), (3, 3), (16, 4)])
def test_gpu_threads_between_2_and_4(cores: int, threads: int) -> None:
    assert placement.gpu_threads(cores) == threads


def test_gpu_rank_bound_and_threaded_at_start(tmp_path, monkeypatch) -> None:
    mine = sorted(os.sched_getaffinity(0))
    root = fake_sys(tmp_path, [0, 0], {0: ",".join(map(str, mine))})
    monkeypatch.setattr(cpu, "cuda_pci_addresses", lambda: GPUS[:2])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    bound: list[set[int]] = []
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda _pid, cores: bound.append(set(cores)))
    before = torch.get_num_threads()
    try:
        text = cpu.set_threads(gpu=True, sys_root=root)
        share = mine[:len(mine) // 2]
        if share:
            assert bound == [set(share)] and f"NUMA node 0 of GPU {GPUS[0]}" in text, text
        want = max(2, min(4, len(share) or len(mine) // 2))
        assert torch.get_num_threads() == want and text.startswith(f"threads {want}/rank (GPU rank"), text
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        assert cpu.set_threads(gpu=True, sys_root=root).startswith(f"threads {torch.get_num_threads()}/rank "
                                                                   "(OMP_NUM_THREADS)")
    finally:
        torch.set_num_threads(before)
