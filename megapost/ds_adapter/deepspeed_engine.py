"""``DeepSpeedEngine``: megapost's Engine (``megapost.engine.Engine``) over the engine that
``deepspeed.initialize`` returns, with megapost's step hooks installed (``megapost.optim.hooks``). The
only implementation of the protocol; what it reads of DeepSpeed's private state goes through
``fragments``. Code not yet moved onto the protocol reaches DeepSpeed's engine as ``.ds``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megapost.ds_adapter import fragments


class DeepSpeedEngine:
    """``ds``: DeepSpeed's (plain or pipeline) engine; ``loss_fn(logits, labels, loss_mask)`` the loss of
    a micro-batch ``{"tokens", "labels", "loss_mask"}`` (the pipeline engine holds its own);
    ``skip_flag``: the device flag the sync-free step sets (``SkipCounter.last``), None where DeepSpeed's
    own step skips (its host counter is read instead)."""

    def __init__(self, ds: Any, loss_fn: Callable[..., torch.Tensor], *, pipeline: bool, tp_rank: int,
                 dp_rank: int, skip_flag: torch.Tensor | None = None) -> None:
        self.ds, self.loss_fn, self.pipeline = ds, loss_fn, pipeline
        self.tp_rank, self.dp_rank, self.skip_flag = tp_rank, dp_rank, skip_flag
        self._skipped_before = 0

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def _losses(self, micro_batches: Iterator[Any], count: int, backward: bool) -> torch.Tensor:
        losses = []
        for i in range(count):
            batch = next(micro_batches)
            loss = self.loss_fn(self.ds(batch["tokens"]), batch["labels"], batch["loss_mask"])
            if backward:
                self.ds.backward(loss)
                if i < count - 1:
                    self.ds.step()  # DeepSpeed counts micro-steps here; the last one is ``step()``
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def forward_backward(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        self._skipped_before = int(getattr(self.ds, "skipped_steps", 0))
        if self.pipeline:  # DeepSpeed's pipeline schedule runs the micro-batches and the step together
            return self.ds.train_batch(data_iter=micro_batches).detach().float()
        return self._losses(micro_batches, count, backward=True)

    def forward_only(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        """Forward of ``count`` micro-batches in the current mode (``train``); the caller holds no_grad.
        The pipeline engine's loss as it returns it (0-d on the last stage, its broadcast copy elsewhere)."""
        if self.pipeline:
            return self.ds.eval_batch(data_iter=micro_batches)
        return self._losses(micro_batches, count, backward=False)

    def train(self, mode: bool = True) -> None:
        """Training (True) or evaluation (False) mode."""
        self.ds.train(mode)

    def step(self) -> torch.Tensor:
        if not self.pipeline:
            self.ds.step()
        if self.skip_flag is not None:
            return self.skip_flag.clone()
        skipped = int(getattr(self.ds, "skipped_steps", 0)) > self._skipped_before
        return torch.tensor(float(skipped))

    def lr(self) -> float | torch.Tensor:
        return self.ds.get_lr()[0]

    def grad_norm(self) -> float | torch.Tensor | None:
        return self.ds.get_global_grad_norm()

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return fragments.owned_grad(param, self.tp_rank, self.dp_rank)

    def owned_state(self, param: nn.Parameter,
                    keys: tuple[str, ...]) -> tuple[int, int, dict[str, torch.Tensor]] | None:
        return fragments.owned_state(self.ds.optimizer, param, self.dp_rank, keys)

    def write_state(self, param: nn.Parameter, key: str, value: torch.Tensor) -> None:
        if fragments.is_mapped(param):
            fragments.write_fragment(param, key, value)
            return
        base = fragments.base_optimizer(self.ds.optimizer)
        target = param if key == fragments.MASTER else base.state[param][key]
        with torch.no_grad():
            target.copy_(value.reshape(target.shape))

    def state_dict(self) -> dict[str, Any]:
        """Module and optimizer ``state_dict`` (live tensors: the caller copies them), schedule, counters."""
        ds = self.ds
        return {"module": ds.module.state_dict(), "optimizer": ds.optimizer.state_dict(),
                "scheduler": ds.lr_scheduler.state_dict(), "global_steps": ds.global_steps,
                "global_samples": ds.global_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ds = self.ds
        ds.module.load_state_dict(state["module"])
        ds.optimizer.load_state_dict(state["optimizer"])
        ds.lr_scheduler.load_state_dict(state["scheduler"])
        ds.global_steps, ds.global_samples = state["global_steps"], state["global_samples"]

    def destroy(self) -> None:
        destroy = getattr(self.ds, "destroy", None)
        if callable(destroy):
            destroy()
