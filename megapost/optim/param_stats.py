"""Megatron-LM's ``--log-params-norm`` and ``--log-num-zeros-in-grad``: each rank adds up the part of
the fp32 masters / reduced gradients it owns (the Engine's ``owned_state`` and ``owned_grad``; tensor-parallel
replicas on TP rank 0 only), one sum over all ranks gives the whole model's value. The local parts stay device
tensors (no host sync); the caller sums and reads them on logging steps only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapost.engine import MASTER, Engine


def _params(engine: Engine) -> list[torch.nn.Parameter]:
    return [p for p in engine.module.parameters() if p.requires_grad]


def local_zeros_in_grad(engine: Engine, tp_rank: int, dp_rank: int) -> torch.Tensor:
    """Exactly-zero elements of the reduced gradient this rank owns (before the optimizer step)."""
    parts = [g for p in _params(engine) if (g := engine.owned_grad(p)) is not None]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=_device(engine))
    return torch.stack([(g.numel() - torch.count_nonzero(g)).to(torch.float64) for g in parts]).sum()


def owned_master(engine: Engine, param: torch.nn.Parameter, tp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s fp32 master this rank counts: of a tensor-parallel shard on every TP rank,
    of a replicated parameter on TP rank 0 only; of those, the slice the engine's optimizer owns here."""
    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
        return None
    owned = engine.owned_state(param, ())
    return None if owned is None else owned[2][MASTER]


def local_params_sq(engine: Engine, tp_rank: int, dp_rank: int) -> torch.Tensor:
    """Sum of squares (fp32 accumulation, returned fp64) of the fp32 master weights this rank owns."""
    parts = [m for p in _params(engine) if (m := owned_master(engine, p, tp_rank)) is not None]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=_device(engine))
    return torch.stack([m.float().pow(2).sum() for m in parts]).sum().double()


def world_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over every rank (a collective: every rank calls it at the same point)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def _device(engine: Engine) -> torch.device:
    return next(engine.module.parameters()).device
