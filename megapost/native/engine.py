"""``NativeEngine``: megapost's Engine (``megapost.engine.Engine``) over megapost's distributed optimizer
(``megapost.parallel.dist_optimizer.DistributedOptimizer``), no DeepSpeed.

A step: ``forward_backward`` runs the micro-batches (each loss divided by their count, as DeepSpeed
scales by the accumulation steps), the gradients accumulate in the optimizer's fp32 buckets and the last
micro-batch's backward reduce-scatters them bucket by bucket (under PP the schedule runs them,
``megapost.native.pipeline``: a bucket is reduce-scattered once each chunk holding its parameters has run
its last backward); ``step`` waits for the reductions, calls
``before_step`` (the trainer's hook: the plugins read ``owned_grad`` there), then the global-norm clip
and the optimizer step on this rank's fp32 shard. A non-finite norm skips on the device (fused AdamW's
``found_inf``: weights, moments and step counts unchanged), the flag recorded by the ``SkipCounter`` and
the lr schedule counting on the device from that flag. The updated weights are all-gathered during the
next forward (the optimizer's forward pre-hooks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megapost.config.errors import ConfigError
from megapost.engine import MASTER, Fragment
from megapost.optim.schedule import WarmupDecaySchedule
from megapost.optim.skips import SkipCounter
from megapost.parallel.dist_optimizer import DistributedOptimizer, seg_slice, takes_found_inf


class NativeEngine:
    """``module`` (this rank's TP part, its parameters views of ``dist``'s buckets), ``loss_fn(logits,
    labels, loss_mask)``, ``dist`` over the data-parallel group, the lr ``scheduler`` over ``dist``'s
    torch optimizer, the ``skips`` counter; ``replicated_owner``: whether this rank counts the parts of
    tensor-parallel-replicated parameters (TP rank 0), as ``owned_grad`` promises one sum over ranks."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor], dist: DistributedOptimizer,
                 scheduler: WarmupDecaySchedule, skips: SkipCounter, *, replicated_owner: bool,
                 hooks: list[Any], samples_per_step: int = 0, pipeline: Any = None) -> None:
        self._module, self.loss_fn, self.dist = module, loss_fn, dist
        self.pipeline = pipeline  # a megapost.native.pipeline.PipelineRunner under PP > 1
        self.lr_scheduler, self.skips, self.replicated_owner = scheduler, skips, replicated_owner
        self.before_step: Callable[[], None] = lambda: None
        self._hooks = hooks
        self.on_device = takes_found_inf(dist.optimizer)
        if self.on_device:
            scheduler.count_on_device(skips.last)
        self.global_steps, self.global_samples, self.samples_per_step = 0, 0, samples_per_step

    # ---- what train/ reads ---------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over the fp32 shards (its param groups' hyperparameters, for the plugins)."""
        return self.dist.optimizer

    @property
    def ds(self) -> NativeEngine:
        """What train/ and the plugin binding still read as DeepSpeed's engine (``module``,
        ``optimizer``, ``lr_scheduler``, ``get_lr``, ``global_steps``), answered by this engine until
        train/ reads only the protocol."""
        return self

    def get_lr(self) -> list[Any]:
        return self.lr_scheduler.get_lr()

    # ---- the protocol ---------------------------------------------------------------------------
    def _losses(self, micro_batches: Iterator[Any], count: int, backward: bool) -> torch.Tensor:
        if self.pipeline is not None:  # the schedule runs the micro-batches; the loss of the last stage
            return self.pipeline.run(micro_batches, backward)
        losses = []
        for i in range(count):
            batch = next(micro_batches)
            loss = self.loss_fn(self._module(batch["tokens"]), batch["labels"], batch["loss_mask"])
            if backward:
                self.dist.start_micro_batch(last=i == count - 1)
                (loss / count).backward()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def forward_backward(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        return self._losses(micro_batches, count, backward=True)

    def forward_only(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        return self._losses(micro_batches, count, backward=False)

    def train(self, mode: bool = True) -> None:
        self._module.train(mode)

    def step(self) -> torch.Tensor:
        self.dist.finish_grad_sync()
        self.before_step()
        skipped = self.dist.apply()
        self.skips.record(skipped)
        if self.on_device:
            self.lr_scheduler.step()  # advances by 1 - skipped on the device
        elif not bool(skipped):
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.samples_per_step
        return skipped.float()

    def lr(self) -> float | torch.Tensor:
        return self.lr_scheduler.get_lr()[0]

    def grad_norm(self) -> torch.Tensor:
        norm = self.dist.grad_norm
        return torch.where(torch.isfinite(norm), norm, torch.inf)

    def _counted(self, param: nn.Parameter) -> bool:
        return bool(getattr(param, "tensor_model_parallel", False)) or self.replicated_owner

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        where = self.dist.owned(param)
        if where is None or not self._counted(param):
            return None
        b, start, end = where
        if b.grad is None:
            return None
        base = self.dist.offset(param) - b.lo
        return b.grad[base + start:base + end]

    def _segment(self, param: nn.Parameter) -> tuple[Any, slice, nn.Parameter] | None:
        """(bucket, the slice of the shard holding this rank's part, the optimizer parameter over it)."""
        where = self.dist.owned(param)
        if where is None:
            return None
        b, start, end = where
        lo = self.dist.offset(param) - b.lo + start
        for _g, seg in b.segments:
            s = seg_slice(b, seg)
            if s.start <= lo < s.stop:
                return b, slice(lo - s.start, lo - s.start + end - start), seg
        raise AssertionError("the segments tile the shard")

    def owned_state(self, param: nn.Parameter, keys: tuple[str, ...]) -> Fragment | None:
        found = self._segment(param)
        if found is None:
            return None
        b, part, seg = found
        start = self.dist.owned(param)[1]  # type: ignore[index]
        state = self.dist.optimizer.state.get(seg, {})
        out = {MASTER: seg.detach()[part]}
        out.update({k: state[k][part] for k in keys if k in state})
        return start, part.stop - part.start, out

    def write_state(self, param: nn.Parameter, key: str, value: torch.Tensor) -> None:
        found = self._segment(param)
        if found is None:
            return
        b, part, seg = found
        state = self.dist.optimizer.state[seg]
        target = seg.detach() if key == MASTER else state.setdefault(key, torch.zeros_like(seg.detach()))
        with torch.no_grad():
            target[part].copy_(value.reshape(-1))

    def state_dict(self) -> dict[str, Any]:
        """Module, this rank's fp32 shards and optimizer state (live tensors: the caller copies them),
        schedule and step count; no collective."""
        self.dist.finish_param_sync()
        return {"module": self._module.state_dict(),
                "optimizer": {"masters": [b.master for b in self.dist.buckets],
                              "torch": self.dist.optimizer.state_dict()},
                "scheduler": self.lr_scheduler.state_dict(), "global_steps": self.global_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dist.finish_param_sync()
        self._module.load_state_dict(state["module"])
        with torch.no_grad():
            for b, master in zip(self.dist.buckets, state["optimizer"]["masters"], strict=True):
                b.master.copy_(master)
        self.dist.optimizer.load_state_dict(state["optimizer"]["torch"])
        self.lr_scheduler.load_state_dict(state["scheduler"])  # its lr back into the param groups
        self.global_steps = state["global_steps"]

    def destroy(self) -> None:
        """Wait for the pending weight gathers; remove the optimizer's hooks (the weights stay)."""
        self.dist.finish_param_sync()
        for handle in self._hooks + [h for b in self.dist.buckets for h in b.hooks]:
            handle.remove()
        self._hooks = []
        for b in self.dist.buckets:
            b.hooks = []

    # ---- what megapost.checkpoint asks (the Engine protocol's checkpoint members) -------------------
    def _segments(self) -> list[nn.Parameter]:
        return [seg for b in self.dist.buckets for _g, seg in b.segments]

    def optimizer_header(self) -> dict[str, Any]:
        states = [self.dist.optimizer.state[s] for s in self._segments() if s in self.dist.optimizer.state]
        step = next((int(s["step"]) for s in states if "step" in s), None)
        keys = sorted({k for s in states for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, JSONABLE)}
                  for g in self.dist.optimizer.param_groups]
        return {"step": step, "keys": keys, "groups": groups}

    def init_optimizer_state(self, keys: list[str], step: int | None,
                             groups: list[dict[str, Any]] | None) -> None:
        opt = self.dist.optimizer
        for seg in self._segments():
            counted = {} if step is None else {"step": torch.tensor(float(step), device=seg.device)}
            opt.state[seg] = {**counted, **{k: torch.zeros_like(seg.detach()) for k in keys}}
        for group, settings in zip(opt.param_groups, groups or [], strict=False):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()
                          if k in group and k not in ("lr", "initial_lr")})

    def held_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        where = self.dist.owned(param)
        return None if where is None else (where[1], where[2] - where[1])

    def partitioned(self) -> bool:
        return True  # the fp32 masters are the shards; the module's weights are gathered from them

    def rebuild_weights(self) -> None:
        self.dist.rebuild_weights()

    def scheduler_state(self) -> dict[str, Any] | None:
        return self.lr_scheduler.state_dict()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.lr_scheduler.load_state_dict(state)

    def counters(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples, "skipped_steps": 0}

    def set_counters(self, counters: dict[str, int]) -> None:
        self.global_steps, self.global_samples = counters["global_steps"], counters["global_samples"]

    def save_native(self, directory: str, tag: str, client: dict[str, Any]) -> None:
        raise ConfigError("--ckpt-format deepspeed with --use-distributed-optimizer: the native engine "
                          "has no files of its own; use the layout-free format")

    def load_native(self, directory: str, tag: str, optimizer: bool,
                    module_only: bool) -> dict[str, Any] | None:
        return None


JSONABLE = (int, float, str, bool, list, tuple, type(None))
