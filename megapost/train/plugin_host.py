"""The plugin host: which plugins measure this step, the micro-batches they see, and every call the
trainer makes into them (megapost.plugin_api.Plugin)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megapost.config.resolved import OptimizerConfig
from megapost.engine import Engine
from megapost.plugin_api import Plugin
from megapost.train.plugin_binding import PluginBinding, bind_plugins


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """Host batch -> device; on CUDA through pinned memory, asynchronously (no host sync)."""
    if device is None or device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class PluginBatches:
    """Iterator wrapper that shows every micro-batch to the plugins measuring this step and hands the
    engine device tensors (the pipeline engine's own ``.to(device)`` would block per micro-batch)."""

    def __init__(self, it: Iterator[dict[str, Any]], pipeline: bool,
                 device: torch.device | None = None) -> None:
        self.it, self.pipeline, self.device = it, pipeline, device
        self.active: list[Plugin] = []
        self.step = 0

    def __iter__(self) -> PluginBatches:
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        for plugin in self.active:
            plugin.on_micro_batch(self.step, batch)
        tokens, labels, mask = (to_device(batch[k], self.device) for k in ("tokens", "labels", "loss_mask"))
        if self.pipeline:
            return (tokens,), (labels, mask)
        return {"tokens": tokens, "labels": labels, "loss_mask": mask}


class PluginHost:
    """The run's plugins and the ones active on the step in progress."""

    def __init__(self, plugins: list[Plugin]) -> None:
        self.plugins = plugins
        self.active: list[Plugin] = []
        self.binding: PluginBinding | None = None

    def bind(self, engine: Engine, schedule: Any, optimizer: OptimizerConfig | None, snapshot: Any,
             restore: Any) -> None:
        """Lend every plugin's ``PluginContext`` the Engine's reads, the lr schedule and the trainer's
        rollback."""
        self.binding = bind_plugins(self.plugins, engine, schedule, optimizer, snapshot, restore)

    def wanting(self, step: int) -> list[Plugin]:
        return [p for p in self.plugins if p.wants_step(step)]

    def begin_step(self, step: int, batches: PluginBatches, module: nn.Module,
                   active: list[Plugin] | None = None) -> list[Plugin]:
        """Start the plugins that want ``step`` (``active``, else asked here) and show them its
        micro-batches."""
        active = self.wanting(step) if active is None else active
        batches.active, batches.step = active, step
        for plugin in active:
            plugin.on_step_begin(step, module)
        return active

    def end_step(self, step: int, active: list[Plugin], loss: Any) -> None:
        """The step's loss to its active plugins: the device tensor to those with ``loss_on_device``, else
        a float (one host read, only when such a plugin is active)."""
        value = float(loss) if any(not p.loss_on_device for p in active) else None
        for plugin in active:
            plugin.on_step_end(step, loss if plugin.loss_on_device else value)

    def before_optimizer_step(self, step: int) -> None:
        for plugin in self.active:
            plugin.before_optimizer_step(step)

    def after_iteration(self, iteration: int) -> None:
        """Every plugin's ``after_iteration`` (which may roll back through its context), then the lr
        requests they made."""
        for plugin in self.plugins:
            plugin.after_iteration(iteration)
        if self.binding is not None:
            self.binding.apply_requests()

    def states(self) -> dict[str, Any]:
        return {p.name: p.state_dict() for p in self.plugins}

    def load_states(self, states: dict[str, Any]) -> None:
        for plugin in self.plugins:
            if plugin.name in states:
                plugin.load_state_dict(states[plugin.name])

    def on_resume(self, iteration: int) -> None:
        for plugin in self.plugins:
            plugin.on_resume(iteration)

    def close(self) -> None:
        for plugin in self.plugins:
            plugin.close()
