"""Reads of a DeepSpeed engine's private state that megapost's plugins need, in one place: the part of a
parameter's reduced gradient a rank owns (under ZeRO 1/2/3 and DeepSpeed's bf16 optimizer) and the fp16
loss scale the gradients still carry, plus the lr-scale request applied to megapost's schedule.

Each rank owns a part of ||grad||^2 so that one sum over all ranks gives the full value:
  * tensor parallelism: shards tagged ``tensor_model_parallel`` count on every TP rank, replicated
    parameters (the RMSNorm gains) only on TP rank 0;
  * ZeRO 1/2 and the bf16 optimizer keep the reduced fp32 gradient as flat partitions: a rank owns the
    fragment of each parameter in its partition (the slice ``safe_get_full_grad`` would contribute to
    its all-reduce), ZeRO-3 its local partition (``safe_get_local_grad``);
  * a full, data-parallel-reduced ``param.grad`` (no ZeRO partitioning) is owned by DP rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megapost.ds_adapter import fragments

owned_grad = fragments.owned_grad  # the rule above, where DeepSpeed's fragments are read


def owned_master(param: nn.Parameter, tp_rank: int, dp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s fp32 master weight this rank owns, by the rule of ``owned_grad``: under
    ZeRO 1/2 and the bf16 optimizer its fragment of the flat fp32 partition, else the parameter itself
    (the master under fp32 ZeRO-0) on DP rank 0."""
    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
        return None
    if fragments.is_mapped(param):  # None: this rank's partition holds no element of param
        owned = fragments.owned_fragment(param, (fragments.MASTER,))
        return None if owned is None else owned[2][fragments.MASTER]
    return param.detach() if dp_rank == 0 else None


def loss_scale(engine: Any) -> float:
    """The fp16 dynamic loss scale the gradients still carry before the step (1 otherwise)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if callable(fp16) and fp16():
        return float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)
    return 1.0


def optimizer_state(engine: Any, param: nn.Parameter) -> dict[str, Any]:
    """The torch optimizer's state of ``param`` when the engine steps a torch optimizer over the module's
    own parameters (ZeRO-0 fp32); {} under ZeRO / bf16, whose optimizers keep flat fp32 partitions."""
    state = getattr(getattr(engine, "optimizer", None), "state", None)
    return dict(state.get(param, {})) if isinstance(state, dict) else {}


def optimizer_hyperparameters(engine: Any) -> dict[str, Any]:
    """The first param group's hyperparameters, without its parameter list (a device lr as a float)."""
    group = engine.optimizer.param_groups[0]
    return {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
            for k, v in group.items() if k != "params"}


def scale_lr(engine: Any, lr: float, warmup: float, rewarm: tuple[int, int, float] | None = None) -> None:
    """Scale the engine's lr schedule (megapost.optim.schedule.WarmupDecaySchedule): peak and minimum
    lr by ``lr``, warmup length by ``warmup``, relative to the configured values; ``rewarm`` adds a
    second warmup (``schedule.rewarm_scale``)."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if not hasattr(scheduler, "scale"):
        raise RuntimeError(f"a plugin asked to scale the lr, but the engine's scheduler "
                           f"({type(scheduler).__name__}) is not megapost's WarmupDecaySchedule")
    scheduler.scale(lr, warmup, rewarm)
