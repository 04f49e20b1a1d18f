"""The learning rate of a step: linear warmup then cosine / linear / constant / WSD decay to --min-lr, a
pure, torch-free function of the step (the engine's schedule and the study's hazard law read it).

WSD (warmup-stable-decay, Megatron's ``--lr-decay-style WSD``): after warmup the lr stays at --lr
until the last ``wsd_decay_iters`` of ``decay_iters``, then anneals to --min-lr with ``wsd_style``.
"""

from __future__ import annotations

import math


def _wsd_coeff(step: int, decay_iters: int, wsd_decay_iters: int, wsd_style: str) -> float:
    start = decay_iters - wsd_decay_iters
    if step <= start:
        return 1.0
    ratio = min(1.0, (step - start) / max(1, wsd_decay_iters))
    if wsd_style == "linear":
        return 1.0 - ratio
    if wsd_style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if wsd_style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    return 2.0 * 0.5**ratio - 1.0  # exponential: 1 at the start of the anneal, 0 at its end


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str,
          wsd_decay_iters: int = 0, wsd_style: str = "exponential", warmup_init: float = 0.0) -> float:
    """Learning rate for optimizer step ``step`` (0-based count of steps already taken); warmup rises
    linearly from ``warmup_init`` (Megatron's --lr-warmup-init) to ``lr``."""
    if warmup > 0 and step < warmup:
        return warmup_init + (lr - warmup_init) * (step + 1) / warmup
    if style == "constant":
        return lr
    if style == "WSD":
        return min_lr + _wsd_coeff(step, decay_iters, wsd_decay_iters, wsd_style) * (lr - min_lr)
    span = max(1, decay_iters - warmup)
    ratio = min(1.0, (step - warmup) / span)
    if style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)
