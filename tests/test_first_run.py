"""First-run robustness on GPU clusters, checked on CPU: the GPU a rank binds, and NCCL errors never
retried through the gloo fallbacks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megapost.parallel import collectives
from megapost.runtime.distributed import device_index


@pytest.mark.parametrize("env, count, expected", [
    ({"LOCAL_RANK": "5"}, 8, 5),
    ({"LOCAL_RANK": "5"}, 1, 0),  # one GPU per task (srun --gpus-per-task=1): always device 0
    ({"LOCAL_RANK": "3"}, 2, 1),
    ({"SLURM_LOCALID": "3"}, 4, 3),  # srun without torchrun
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "3"}, 4, 1),  # torchrun's own local rank wins
    ({}, 4, 0),
])
def test_device_index(monkeypatch, env: dict[str, str], count: int, expected: int) -> None:
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert device_index(count) == expected


@pytest.mark.parametrize("backend, raised", [("nccl", True), ("gloo", False)])
def test_collective_fallback_only_on_gloo(monkeypatch, backend: str, raised: bool) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(collectives, "_unsupported", set())

    def fail() -> None:
        try:
            raise RuntimeError("NCCL error: unhandled system error")
        except RuntimeError:
            collectives._fallback_or_raise("all_gather", None)

    if raised:
        with pytest.raises(RuntimeError, match="NCCL error"):
            fail()
        assert not collectives._unsupported
    else:
        fail()
        assert ("all_gather", "gloo") in collectives._unsupported
