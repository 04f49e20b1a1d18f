"""The step runner: one optimizer step (or a forward-only pass) of micro-batches through the Engine
(megapost.engine), the data-parallel mean of its loss, and the engine's grad norm as it keeps it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from megapost.engine import Engine
from megapost.parallel.state import ParallelState
from megapost.train.plugin_host import PluginBatches, PluginHost


class StepRunner:
    """Runs steps of ``grad_accum_steps`` micro-batches from ``train_iter_fn(consumed_samples)``."""

    def __init__(self, engine: Engine, loss_fn: Any, pstate: ParallelState, device: torch.device,
                 grad_accum_steps: int, pipeline: bool, host: PluginHost,
                 train_iter_fn: Callable[[int], Iterator[dict[str, Any]]] | None) -> None:
        self.engine, self.loss_fn, self.pstate, self.device = engine, loss_fn, pstate, device
        self.grad_accum_steps, self.pipeline, self.host = grad_accum_steps, pipeline, host
        self.train_iter_fn = train_iter_fn
        self.batches: PluginBatches | None = None

    def start_data(self, consumed_samples: int) -> None:
        """Training batches from sample ``consumed_samples`` on."""
        assert self.train_iter_fn is not None
        self.batches = PluginBatches(self.train_iter_fn(consumed_samples), self.pipeline, self.device)

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.pstate.dp_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.pstate.dp_group)
            value /= self.pstate.dp_size
        return value

    def micro_losses(self, batches: Iterator[Any], backward: bool) -> torch.Tensor:
        """The data-parallel mean loss of one step's micro-batches: forward and backward (the optimizer
        step follows), or forward only."""
        # the model's output goes straight to the loss: the head may leave the logits to it (ce fusion)
        with getattr(self.engine.module, "head_output", nullcontext)():
            if backward:
                loss = self.engine.forward_backward(batches, self.grad_accum_steps)
            else:
                loss = self.engine.forward_only(batches, self.grad_accum_steps)
        if backward:
            self.engine.step()
        return self.dp_mean(loss)

    def skip_batches(self) -> None:
        """Consume one optimizer step's micro-batches without running them (--iterations-to-skip)."""
        assert self.batches is not None
        for _ in range(self.grad_accum_steps):
            next(self.batches.it)

    def z_term(self) -> torch.Tensor | None:
        """--z-loss: this step's z term averaged over this rank's micro-batches, on the ranks that
        computed the loss (None elsewhere, and without --z-loss); averaged over DP at log time."""
        take = getattr(self.loss_fn, "take_z_terms", None)
        terms = take() if take is not None else []
        return torch.stack(terms).mean() if terms else None

    def train_step(self, step: int) -> torch.Tensor:
        self.z_term()  # drop terms from evaluation passes (no collective)
        assert self.batches is not None
        active = self.host.begin_step(step, self.batches, self.engine.module)
        self.host.active = active
        if self.pipeline:  # DeepSpeed's pipeline engine returns the data-parallel mean itself
            loss = self.engine.forward_backward(self.batches, self.grad_accum_steps)
            self.engine.step()
        else:
            loss = self.micro_losses(self.batches, backward=True)
        self.host.end_step(step, active, loss)
        self.batches.active = []
        return loss

    def measure_at_init(self) -> None:
        """Step 0: a forward-only pass on the first training batch for plugins that want it."""
        active = self.host.wanting(0)
        if not active:
            return
        assert self.train_iter_fn is not None
        batches = PluginBatches(self.train_iter_fn(0), self.pipeline, self.device)
        self.host.begin_step(0, batches, self.engine.module, active)
        with torch.no_grad():
            if self.pipeline:
                loss = self.engine.forward_only(batches, self.grad_accum_steps)
            else:
                loss = self.micro_losses(batches, backward=False)
        self.host.end_step(0, active, loss)

    def grad_norm(self) -> Any:
        """The engine's global grad norm as it keeps it (a device tensor on some paths): converted
        only at log time, so a step costs no extra host sync."""
        norm = self.engine.grad_norm()
        return norm.detach() if isinstance(norm, torch.Tensor) else norm
