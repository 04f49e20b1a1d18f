"""The trainer's side of ``PluginContext``: the engine's module and loss scale, in-memory rollback, and
the lr-scale requests the trainer applies after the plugins' ``after_iteration``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from megapost.optim import accessors
from megapost.plugin_api import Plugin


class PluginBinding:
    """A ``megapost.plugin_api.PluginServices`` over a DeepSpeed engine; ``snapshot`` / ``restore`` are the
    trainer's (None: not available, e.g. a benchmark or test driving the engine alone)."""

    def __init__(self, engine: Any, snapshot: Callable[[], dict[str, Any]] | None = None,
                 restore: Callable[[dict[str, Any], bool], None] | None = None) -> None:
        self.engine, self._snapshot, self._restore = engine, snapshot, restore
        self.lr_request: tuple[float, float, Any] | None = None

    def module(self) -> nn.Module:
        return self.engine.module

    def loss_scale(self) -> float:
        return accessors.loss_scale(self.engine)

    def snapshot(self) -> dict[str, Any]:
        if self._snapshot is None:
            raise RuntimeError("PluginContext.snapshot: this engine is driven without a Trainer")
        return self._snapshot()

    def restore(self, snap: dict[str, Any], skip_data: bool) -> None:
        if self._restore is None:
            raise RuntimeError("PluginContext.restore: this engine is driven without a Trainer")
        self._restore(snap, skip_data)

    def request_lr_scale(self, lr: float, warmup: float, rewarm: tuple[int, int, float] | None) -> None:
        self.lr_request = (lr, warmup, rewarm)

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        return accessors.optimizer_state(self.engine, param)

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        return accessors.optimizer_hyperparameters(self.engine)

    def apply_requests(self) -> None:
        """Apply the last lr-scale request (if any) to the engine's schedule."""
        if self.lr_request is not None:
            accessors.scale_lr(self.engine, *self.lr_request)
            self.lr_request = None


def bind_plugins(plugins: Sequence[Plugin], engine: Any,
                 snapshot: Callable[[], dict[str, Any]] | None = None,
                 restore: Callable[[dict[str, Any], bool], None] | None = None) -> PluginBinding:
    """Bind every plugin's context to ``engine`` (and the trainer's rollback); returns the binding."""
    binding = PluginBinding(engine, snapshot, restore)
    for plugin in plugins:
        ctx = getattr(plugin, "ctx", None)
        if ctx is not None:
            ctx.bind(binding)
    return binding
