"""Linear warmup then cosine / linear / constant / WSD decay to --min-lr, a pure function of the step.

``lr_at`` (megapost/utils/lr_schedule.py) is the schedule, a pure function of the step.

With a sync-free step (``count_on_device``) the schedule runs on the device: the step count is a device
tensor that a skipped step (non-finite gradient) does not advance, and the lr a device tensor (fused
AdamW takes it as is) looked up in a table of ``lr_at`` values, so no step waits for the host.
"""

from __future__ import annotations

from typing import Any

import torch

from megapost.utils.lr_schedule import lr_at

__all__ = ["WarmupDecaySchedule", "lr_at", "rewarm_scale"]


def rewarm_scale(step: int, rewarm: tuple[int, int, float] | None) -> float:
    """A second warmup on top of the schedule (the collapse guard's ``rewarm`` remedy): from ``start`` the
    lr is scaled by a ramp from ``fraction`` to 1 over ``steps`` steps; 1 before ``start`` and after."""
    if rewarm is None or step < rewarm[0]:
        return 1.0
    start, steps, fraction = rewarm
    return fraction + (1.0 - fraction) * min(1.0, (step - start) / max(1, steps))


class WarmupDecaySchedule:
    """Sets the lr of every param group; its state is the step count (saved in checkpoints)."""

    _count: torch.Tensor | None = None  # on the device (count_on_device): steps taken, skips excluded

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, min_lr: float, warmup: int,
                 decay_iters: int, style: str, wsd_decay_iters: int = 0,
                 wsd_style: str = "exponential", warmup_init: float = 0.0) -> None:
        self.optimizer = optimizer
        self.params = dict(lr=lr, min_lr=min_lr, warmup=warmup, decay_iters=decay_iters, style=style,
                           wsd_decay_iters=wsd_decay_iters, wsd_style=wsd_style, warmup_init=warmup_init)
        self.configured = dict(lr=lr, min_lr=min_lr, warmup=warmup)
        self.num_steps = 0
        self.rewarm: tuple[int, int, float] | None = None  # (start step, steps, start fraction): rewarm_scale
        self._apply()

    def scale(self, lr: float = 1.0, warmup: float = 1.0,
              rewarm: tuple[int, int, float] | None = None) -> None:
        """Peak and minimum lr times ``lr``, warmup length times ``warmup`` (rounded), relative to the
        configured schedule, and the second warmup ``rewarm`` (None: none); the lr of the current step is
        applied at once."""
        c = self.configured
        self.rewarm = rewarm
        self.params.update(lr=c["lr"] * lr, min_lr=c["min_lr"] * lr, warmup=round(c["warmup"] * warmup))
        if self._count is not None:
            self._table = self._lr_table(self._table.device)
        self._apply()

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken (skipped ones excluded); a host read when counted on the device."""
        return self._steps if self._count is None else int(self._count)

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self._steps = int(value)
        if self._count is not None:
            self._count.fill_(int(value))

    def count_on_device(self, skipped: torch.Tensor) -> None:
        """Count steps and set the lr on ``skipped``'s device from now on: ``step()`` advances the count
        by ``1 - skipped`` (the flag the sync-free step sets) and writes the lr into one device tensor
        that every param group holds (the optimizer must take a tensor lr: fused AdamW)."""
        device = skipped.device
        self._skipped = skipped
        self._table = self._lr_table(device)
        self._count = torch.tensor(self._steps, dtype=torch.long, device=device)
        self._lr = torch.zeros((), dtype=torch.float32, device=device)
        self._apply()

    def _lr_table(self, device: torch.device) -> torch.Tensor:
        """``lr_at`` x ``rewarm_scale`` for every step up to where the lr stops changing."""
        p, end = self.params, self.rewarm[0] + self.rewarm[1] if self.rewarm else 0
        last = max(p["decay_iters"], p["warmup"], end) + 1
        values = [lr_at(s, **p) * rewarm_scale(s, self.rewarm) for s in range(last + 1)]
        return torch.tensor(values, dtype=torch.float32, device=device)

    def get_lr(self) -> list[Any]:
        """The lr of the next step (a device tensor when counted on the device)."""
        if self._count is not None:
            return [self._lr]
        return [lr_at(self._steps, **self.params) * rewarm_scale(self._steps, self.rewarm)]

    def get_last_lr(self) -> list[Any]:
        return self.get_lr()

    def _apply(self) -> None:
        if self._count is not None:
            index = self._count.clamp(max=self._table.numel() - 1).reshape(1)
            self._lr.copy_(self._table.index_select(0, index).reshape(()))
            for group in self.optimizer.param_groups:  # again after an optimizer load_state_dict
                group["lr"] = self._lr
            return
        lr = self.get_lr()[0]
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: Any = None) -> None:
        if self._count is not None:
            self._count.add_((1 - self._skipped).to(torch.long))  # a skipped step leaves the schedule
        else:
            self._steps += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, **self.params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
