"""The Engine: what the trainer (``megapost.train``) and the checkpoint (``megapost.checkpoint``) ask of
whatever runs a parallelised model's forward/backward and optimizer step. One meaning of the word in
megapost: DeepSpeed's engine is wrapped by its one implementation,
``megapost.ds_adapter.deepspeed_engine.DeepSpeedEngine``; a native torch one (FSDP2, a distributed
optimizer) would be a second beside it (docs/architecture.md).

Structural typing: an implementation need not import this module (``ds_adapter`` imports nothing of
megapost). Everything here is per rank; tensors stay on the device (no host read).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

MASTER = "fp32"  # the key of a parameter's fp32 master weight among its state fragments

Fragment = tuple[int, int, dict[str, torch.Tensor]]  # (start, numel, {kind: 1-D tensor}) in the flat param


@runtime_checkable
class Engine(Protocol):
    """A rank's model, optimizer and lr schedule, driven one optimizer step at a time."""

    @property
    def module(self) -> nn.Module:
        """The model this rank trains (its tensor/pipeline-parallel part)."""

    def forward_backward(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        """Forward and backward of ``count`` micro-batches (gradients accumulate): their mean loss on
        this rank, detached, before any data-parallel mean. An implementation whose schedule interleaves
        the optimizer step with the micro-batches (DeepSpeed's pipeline) may apply it here; ``step``
        then only reports it."""

    def forward_only(self, micro_batches: Iterator[Any], count: int) -> torch.Tensor:
        """Forward of ``count`` micro-batches in the current mode (the caller holds ``torch.no_grad``):
        their mean loss on this rank."""

    def train(self, mode: bool = True) -> None:
        """Training (True) or evaluation (False) mode, as ``nn.Module.train``."""

    def step(self) -> torch.Tensor:
        """The optimizer step after a ``forward_backward``: gradients reduced, clipped and applied, the
        lr schedule advanced; or, when the gradient norm is not finite, nothing changed. A 0-d device
        tensor, nonzero when the step was skipped."""

    def lr(self) -> float | torch.Tensor:
        """The learning rate of the next step as the schedule keeps it (a device tensor when the schedule
        counts on the device: no host read; it changes in place)."""

    def grad_norm(self) -> float | torch.Tensor | None:
        """The last step's global gradient norm as the engine keeps it (a device tensor on some paths)."""

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The part of ``param``'s reduced gradient this rank owns (one sum over all ranks of each part's
        squares gives the whole norm), or None; between ``forward_backward`` and ``step``."""

    def owned_state(self, param: nn.Parameter, keys: tuple[str, ...]) -> Fragment | None:
        """The fragment of ``param`` (flattened) this rank owns, as 1-D views of the live state: its fp32
        master under ``MASTER`` and the optimizer-state tensors ``keys`` (Adam's "exp_avg", ...); None
        when this rank owns none of it."""

    def write_state(self, param: nn.Parameter, key: str, value: torch.Tensor) -> None:
        """Copy ``value`` (this rank's fragment of ``param``, 1-D) into its ``MASTER`` or state ``key``."""

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly from here in this process (module, optimizer, schedule, step
        counters), for an in-memory rollback."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a ``state_dict``."""

    def destroy(self) -> None:
        """Release what the engine holds (buffers, hooks, background work)."""

    # ---- what megapost.checkpoint asks (it never sees the implementation's objects) ----------
    def optimizer_header(self) -> dict[str, Any]:
        """What a checkpoint records of the optimizer besides its tensors: ``{"step": the optimizer's
        step count or None, "keys": the sorted keys of its per-parameter state tensors ("exp_avg", ...),
        "groups": each param group's JSON-able settings but its params}``. Afterwards ``owned_state``
        returns views of the current state tensors."""

    def init_optimizer_state(self, keys: list[str], step: int | None,
                             groups: list[dict[str, Any]] | None) -> None:
        """Before a load writes state in: zeros under ``keys`` (and the count ``step``) for every
        parameter; each group's settings from ``groups`` (all but the lr, the schedule's)."""

    def held_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        """(start, numel) of the flattened ``param`` whose master and state this rank holds (what
        ``write_state`` writes): all of it when the optimizer keeps it whole, its partition when the
        optimizer partitions it over data-parallel ranks; None when it holds none of it."""

    def partitioned(self) -> bool:
        """Every parameter's master is partitioned over data-parallel ranks and ``rebuild_weights``
        rebuilds the module's weights from the masters (the same answer on every rank)."""

    def rebuild_weights(self) -> None:
        """The module's weights from the masters, all-gathered (collective; after ``write_state``)."""

    def scheduler_state(self) -> dict[str, Any] | None:
        """The lr schedule's state (JSON-able), None without one."""

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        """The lr schedule back to ``state``; its lr applied to the optimizer."""

    def counters(self) -> dict[str, int]:
        """``global_steps``, ``global_samples``, ``skipped_steps``: what the engine counted."""

    def set_counters(self, counters: dict[str, int]) -> None:
        """The engine's counters back to ``counters`` (zeros: a fresh start, --finetune)."""

    def save_native(self, directory: str, tag: str, client: dict[str, Any]) -> None:
        """``--ckpt-format deepspeed``: the implementation's own checkpoint files of this rank into
        ``directory/tag`` with ``client`` inside (an implementation without its own: refuses in one line)."""

    def load_native(self, directory: str, tag: str, optimizer: bool,
                    module_only: bool) -> dict[str, Any] | None:
        """Load ``directory/tag``'s own files (``optimizer``: with optimizer and schedule state;
        ``module_only``: the weights only): the client state saved with them, None when nothing loaded."""
