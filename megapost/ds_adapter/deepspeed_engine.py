"""``DeepSpeedEngine``: megapost's Engine (``megapost.engine.Engine``) over the engine that
``deepspeed.initialize`` returns, with megapost's step hooks installed (``megapost.optim.hooks``). The
only implementation of the protocol; what it reads of DeepSpeed's private state goes through
``fragments``. The plugin host still binds DeepSpeed's engine as ``.ds``; the trainer and the checkpoint
use the protocol only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megapost.ds_adapter import fragments

_JSONABLE = (int, float, str, bool, list, tuple, type(None))


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

    # ---- the checkpoint's side of the protocol -------------------------------------------------
    def _base(self) -> torch.optim.Optimizer:
        return fragments.base_optimizer(self.ds.optimizer)

    def optimizer_header(self) -> dict[str, Any]:
        base = self._base()
        step = next((int(st["step"]) for st in base.state.values() if "step" in st), None)
        keys = sorted({k for st in base.state.values() for k, v in st.items()
                       if torch.is_tensor(v) and v.dim() > 0})
        if keys:
            fragments.link_state(self.ds.optimizer)
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, _JSONABLE)}
                  for g in base.param_groups]
        return {"step": step, "keys": keys, "groups": groups}

    def init_optimizer_state(self, keys: list[str], step: int | None,
                             groups: list[dict[str, Any]] | None) -> None:
        base = self._base()
        for group in base.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                device = p.device if on_device else torch.device("cpu")
                counted = {} if step is None else {"step": torch.tensor(float(step), device=device)}
                base.state[p] = {**counted, **{k: torch.zeros_like(p, memory_format=torch.preserve_format)
                                               for k in keys}}
        fragments.link_state(self.ds.optimizer)
        if not groups or len(groups) != len(base.param_groups):
            return
        for group, settings in zip(base.param_groups, groups, strict=True):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()
                          if k in group and k not in ("lr", "initial_lr")})

    def held_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        return fragments.fragment_address(param) if fragments.is_mapped(param) else (0, param.numel())

    def partitioned(self) -> bool:
        return all(fragments.is_mapped(p) for p in self.ds.module.parameters()) and \
            fragments.can_rebuild_weights(self.ds.optimizer)

    def rebuild_weights(self) -> None:
        fragments.rebuild_weights(self.ds.optimizer)

    def scheduler_state(self) -> dict[str, Any] | None:
        scheduler = self.ds.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else None

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        if self.ds.lr_scheduler is not None:
            self.ds.lr_scheduler.load_state_dict(state)

    def counters(self) -> dict[str, int]:
        ds = self.ds
        return {"global_steps": ds.global_steps, "global_samples": ds.global_samples,
                "skipped_steps": ds.skipped_steps}

    def set_counters(self, counters: dict[str, int]) -> None:
        ds = self.ds
        ds.global_steps, ds.global_samples = counters["global_steps"], counters["global_samples"]
        ds.skipped_steps = counters["skipped_steps"]

    def save_native(self, directory: str, tag: str, client: dict[str, Any]) -> None:
        self.ds.save_checkpoint(directory, tag=tag, client_state=client, save_latest=False)

    def load_native(self, directory: str, tag: str, optimizer: bool,
                    module_only: bool) -> dict[str, Any] | None:
        path, client = self.ds.load_checkpoint(directory, tag=tag, load_optimizer_states=optimizer,
                                               load_lr_scheduler_states=optimizer,
                                               load_module_only=module_only)
        return None if path is None else client
