"""Linear warmup then cosine (or linear/constant) decay to --min-lr, as a pure function of the step."""

from __future__ import annotations

import math
from typing import Any

import torch


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based count of steps already taken)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    span = max(1, decay_iters - warmup)
    ratio = min(1.0, (step - warmup) / span)
    if style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


class WarmupDecaySchedule:
    """Sets the lr of every param group; its state is the step count (saved in checkpoints)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, min_lr: float, warmup: int,
                 decay_iters: int, style: str) -> None:
        self.optimizer = optimizer
        self.params = dict(lr=lr, min_lr=min_lr, warmup=warmup, decay_iters=decay_iters, style=style)
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> list[float]:
        return [lr_at(self.num_steps, **self.params)]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        lr = self.get_lr()[0]
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: Any = None) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, **self.params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
