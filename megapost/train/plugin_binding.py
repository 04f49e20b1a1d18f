"""The trainer's side of ``PluginContext``: the Engine's module, owned gradients, lr and optimizer state,
in-memory rollback, and the lr-scale requests the trainer applies after the plugins' ``after_iteration``.
Everything goes through the Engine protocol (megapost.engine) and megapost's own lr schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megapost.config.resolved import OptimizerConfig
from megapost.engine import Engine
from megapost.plugin_api import Plugin

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


class PluginBinding:
    """A ``megapost.plugin_api.TrainerServices`` over an ``Engine``: ``schedule`` is the run's lr schedule
    (megapost.optim.schedule.WarmupDecaySchedule), ``optimizer`` its typed config; ``snapshot`` /
    ``restore`` the trainer's (None: not available, e.g. a benchmark driving the engine alone)."""

    def __init__(self, engine: Engine, schedule: Any = None, optimizer: OptimizerConfig | None = None,
                 snapshot: Callable[[], dict[str, Any]] | None = None,
                 restore: Callable[[dict[str, Any], bool], None] | None = None) -> None:
        self.engine, self.schedule, self.optimizer = engine, schedule, optimizer
        self._snapshot, self._restore = snapshot, restore
        self.lr_request: tuple[float, float, Any] | None = None

    def module(self) -> nn.Module:
        return self.engine.module

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.engine.owned_grad(param)

    def snapshot(self) -> dict[str, Any]:
        if self._snapshot is None:
            raise RuntimeError("PluginContext.snapshot: this engine is driven without a Trainer")
        return self._snapshot()

    def restore(self, snap: dict[str, Any], skip_data: bool) -> None:
        if self._restore is None:
            raise RuntimeError("PluginContext.restore: this engine is driven without a Trainer")
        self._restore(snap, skip_data)

    def request_lr_scale(self, lr: float, warmup: float, rewarm: tuple[int, int, float] | None) -> None:
        if not hasattr(self.schedule, "scale"):
            raise RuntimeError(f"a plugin asked to scale the lr, but the run's schedule "
                               f"({type(self.schedule).__name__}) is not megapost's WarmupDecaySchedule")
        self.lr_request = (lr, warmup, rewarm)

    def lr(self) -> float:
        return float(self.engine.lr())

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        """The Engine's state fragment of ``param`` when this rank holds all of it, shaped as ``param``."""
        try:
            owned = self.engine.owned_state(param, ADAM_STATE)
        except KeyError:  # no state yet (before the first step), or not Adam's
            return {}
        if owned is None or owned[1] != param.numel():
            return {}
        state = {k: v for k, v in owned[2].items() if k in ADAM_STATE}
        out: dict[str, Any] = {k: v.view(param.shape) for k, v in state.items() if k != "step"}
        if "step" in state:
            out["step"] = float(state["step"].reshape(-1)[0])
        return out

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        if self.optimizer is None:
            raise RuntimeError("PluginContext.optimizer_hyperparameters: no optimizer config bound")
        o = self.optimizer
        return {"betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps, "weight_decay": o.weight_decay,
                "lr": self.lr()}

    def apply_requests(self) -> None:
        """Apply the last lr-scale request (if any) to the schedule."""
        if self.lr_request is not None:
            self.schedule.scale(*self.lr_request)
            self.lr_request = None


def bind_plugins(plugins: Sequence[Plugin], engine: Engine, schedule: Any = None,
                 optimizer: OptimizerConfig | None = None,
                 snapshot: Callable[[], dict[str, Any]] | None = None,
                 restore: Callable[[dict[str, Any], bool], None] | None = None) -> PluginBinding:
    """Bind every plugin's context to ``engine`` (and the trainer's schedule and rollback)."""
    binding = PluginBinding(engine, schedule, optimizer, snapshot, restore)
    for plugin in plugins:
        ctx = getattr(plugin, "ctx", None)
        if ctx is not None:
            ctx.bind(binding)
    return binding
