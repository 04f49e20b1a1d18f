"""The trainer's plugin interface and discovery through the ``megapost.plugins`` entry-point group.

The trainer never imports a plugin; it calls these methods at fixed points. On steps for which
``wants_step`` is False nothing else is called, so a plugin costs nothing there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from torch import nn

from megapost.model.config import ModelConfig
from megapost.parallel.state import ParallelState

ENTRY_POINT_GROUP = "megapost.plugins"


@dataclass
class PluginContext:
    """What a plugin may use: the run's arguments, model config, parallel layout and log sinks."""

    args: argparse.Namespace
    model_config: ModelConfig
    parallel: ParallelState
    tensorboard_dir: str | None
    writer: Any = None  # torch.utils.tensorboard.SummaryWriter on the logging rank, else None


class Plugin:
    """Base class: override what you need. ``step`` is the 1-based optimizer step about to run
    (0 = a measurement at initialisation before any update)."""

    name = "plugin"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Register the plugin's own flags (called before parsing)."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    def on_model_built(self, model: nn.Module) -> None:
        """``model``: this rank's module (a pipeline stage under PP), before DeepSpeed wraps it."""

    def wants_step(self, step: int) -> bool:
        return False

    def on_step_begin(self, step: int, model: nn.Module) -> None:
        """A wanted step starts (attach probes' listeners here)."""

    def on_micro_batch(self, step: int, batch: dict[str, Any]) -> None:
        """Every micro-batch this rank loads on a wanted step (tokens, labels, loss_mask)."""

    def before_optimizer_step(self, step: int, engine: Any) -> None:
        """Gradients are reduced across data-parallel ranks, the optimizer has not stepped yet."""

    def on_step_end(self, step: int, loss: float) -> None:
        """A wanted step finished (detach listeners, reduce across shards, write logs)."""

    def after_iteration(self, iteration: int, trainer: Any) -> None:
        """Every optimizer step, after logging/eval/save; ``trainer.snapshot()`` / ``trainer.restore(s)``
        (megapost.train.trainer.Trainer) return to an earlier state in memory."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_resume(self, iteration: int) -> None:
        """The run continues from a checkpoint at ``iteration``: drop own outputs logged past it."""

    def close(self) -> None:
        pass


def available_plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def plugin_classes(names: str | None) -> list[type[Plugin]]:
    """Resolve ``--plugins a,b`` to classes; unknown names are a clear error."""
    if not names:
        return []
    found = available_plugins()
    classes = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in found:
            raise SystemExit(
                f"error: --plugins {name!r} is not installed (known: {sorted(found) or 'none'}); "
                "reinstall with `pip install -e .` or check the name"
            )
        classes.append(found[name].load())
    return classes
