"""Skipped optimizer steps, counted on the device: a step whose gradient norm is not finite leaves the
weights, both Adam moments, the optimizer's step count and the lr schedule as they were
(``megapost.ds_adapter.steps``) and is counted here, without a host read; the trainer reads the counts
at log time (``skipped iterations`` in the log line and TensorBoard, as Megatron-LM logs them) and stops
after ``--max-consecutive-skipped-iterations`` in a row."""

from __future__ import annotations

from collections.abc import Callable

import torch


class SkipCounter:
    """Per-step skip flags folded into device counters: the last step's flag (the lr schedule reads
    it), the total and the current run of consecutive skips."""

    mode = "device"  # how a non-finite step is skipped (megapost.ds_adapter.engine.install): device,
    # deepspeed (DeepSpeed's own host-synchronising step, counted by it) or none
    skipped_by_deepspeed: Callable[[], int] = staticmethod(lambda: 0)

    def __init__(self, device: torch.device | str) -> None:
        self.last = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: the last step was skipped
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.consecutive = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, skipped: torch.Tensor) -> None:
        """One optimizer step's flag (a 0-d bool or float device tensor); device ops only."""
        flag = skipped.to(torch.float32).reshape(())
        self.last.copy_(flag)
        self.total.add_(flag)
        self.consecutive.mul_(flag).add_(flag)

    def read(self) -> tuple[int, int]:
        """(total, consecutive) on the host: one device read (log time only); the total includes the
        steps DeepSpeed's own step skipped (its consecutive runs are not tracked)."""
        total, consecutive = torch.stack([self.total, self.consecutive]).tolist()
        return int(total) + self.skipped_by_deepspeed(), int(consecutive)
