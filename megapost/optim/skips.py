"""Skipped optimizer steps, counted on the device: a step whose gradient norm is not finite leaves the
weights, both Adam moments, the optimizer's step count and the lr schedule as they were
(``megapost.ds_adapter.steps``) and is counted here, without a host read; the trainer reads the counts
at log and save time (``skipped iterations`` in the log line and TensorBoard, as Megatron-LM logs them)
and stops after ``--max-consecutive-skipped-iterations`` in a row — exactly: the iteration at which a
run of skips first reached the limit is kept on the device, so a run that ended between two log steps
is still caught. The counts are saved with each checkpoint and continue on a resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class SkipCounts(NamedTuple):
    total: int  # skipped steps since the run began (over resumes)
    consecutive: int  # the current run of consecutive skips
    longest: int  # the longest run of consecutive skips so far
    reached_at: int  # the iteration at which a run first reached ``SkipCounter.limit`` (0: never)


class SkipCounter:
    """Per-step skip flags folded into device counters: the last step's flag (the lr schedule reads
    it), the total, the current and the longest run of consecutive skips, and where a run reached
    ``limit``. The trainer sets ``iteration`` (a host int) before each step: no host read."""

    mode = "device"  # how a non-finite step is skipped (megapost.ds_adapter.step_hooks.install): device,
    # deepspeed (DeepSpeed's own host-synchronising step, counted by it) or none
    skipped_by_deepspeed: Callable[[], int] = staticmethod(lambda: 0)
    KEYS = ("total", "consecutive", "longest", "reached_at")

    def __init__(self, device: torch.device | str, limit: int = 0) -> None:
        self.limit, self.iteration = limit, 0
        self.last = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: the last step was skipped
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.consecutive = torch.zeros((), dtype=torch.float32, device=device)
        self.longest = torch.zeros((), dtype=torch.float32, device=device)
        self.reached_at = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, skipped: torch.Tensor) -> None:
        """One optimizer step's flag (a 0-d bool or float device tensor); device ops only."""
        flag = skipped.to(torch.float32).reshape(())
        self.last.copy_(flag)
        self.total.add_(flag)
        self.consecutive.mul_(flag).add_(flag)
        torch.maximum(self.longest, self.consecutive, out=self.longest)
        if self.limit:
            first = (self.consecutive >= self.limit) & (self.reached_at == 0)
            self.reached_at.masked_fill_(first, float(self.iteration))

    def read(self) -> SkipCounts:
        """The counts on the host: one device read (log and save time only); the total includes the
        steps DeepSpeed's own step skipped (its consecutive runs are not tracked)."""
        total, consecutive, longest, reached = torch.stack([getattr(self, k) for k in self.KEYS]).tolist()
        total += self.skipped_by_deepspeed()
        return SkipCounts(int(total), int(consecutive), int(longest), int(reached))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The counters (device copies: no host read) for a checkpoint."""
        return {k: getattr(self, k).detach().clone() for k in self.KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's counters (a tag without them: from zero)."""
        for k in self.KEYS:
            if k in state:
                getattr(self, k).copy_(torch.as_tensor(state[k], dtype=torch.float32).reshape(()))
        self.last.zero_()
