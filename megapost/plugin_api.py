"""The plugin interface: everything a plugin may import from megapost, and discovery through the
``megapost.plugins`` entry-point group.

The trainer never imports a plugin; it calls ``Plugin``'s methods at fixed points. On steps for which
``wants_step`` is False nothing else is called, so a plugin costs nothing there. A plugin sees the run
through its ``PluginContext`` (the flags, read-only; model config, parallel layout, writers; once the
trainer is built, this rank's parameters and the gradient part it owns, an lr-scale request, in-memory
snapshot/restore), never the Trainer, the DeepSpeed engine or the parser's Namespace. The names
re-exported below are the rest of megapost a plugin may use (import-linter holds ``collapse_metrics``
to this module).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn

from megapost.config.errors import ConfigError
from megapost.data.gpt_dataset import GPTDataset, split_document_ranges
from megapost.data.indexed_dataset import IndexedDataset
from megapost.model import LlamaModel, ModelConfig, set_listener
from megapost.model.init import matrix_std
from megapost.model.rope import apply_rope_tables
from megapost.optim import accessors
from megapost.parallel.collectives import all_gather, all_reduce
from megapost.parallel.state import ParallelState
from megapost.study.boundary_law import Law, load_law, run_factors
from megapost.utils.atomic import atomic_path, atomic_write_text

__all__ = [
    "ENTRY_POINT_GROUP", "ConfigError", "Flags", "GPTDataset", "IndexedDataset", "Law", "LlamaModel",
    "ModelConfig", "ParallelState", "Plugin", "PluginContext", "PluginServices", "all_gather", "all_reduce",
    "apply_rope_tables", "atomic_path", "atomic_write_text", "available_plugins", "matrix_std",
    "load_law", "plugin_classes", "run_factors", "set_listener", "split_document_ranges",
]

ENTRY_POINT_GROUP = "megapost.plugins"


class PluginServices(Protocol):
    """What the trainer lends a bound ``PluginContext`` (megapost.train.plugin_binding)."""

    def module(self) -> nn.Module: ...

    def loss_scale(self) -> float: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, snap: dict[str, Any], skip_data: bool) -> None: ...

    def request_lr_scale(self, lr: float, warmup: float, rewarm: tuple[int, int, float] | None) -> None: ...

    def lr(self) -> float: ...

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]: ...

    def optimizer_hyperparameters(self) -> dict[str, Any]: ...


class Flags:
    """Every parsed flag by dest (``Config.flags``: plugins' own included), read-only, by attribute
    (``flags.collapse_interval``) or ``flags.get(dest, default)``; a copy, never the parser's Namespace."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"no flag {name!r}") from None

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return Flags, (dict(self._values),)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"flags are read-only (set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"flags are read-only (delete {name!r})")

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)

    def __repr__(self) -> str:
        return f"Flags({dict(self._values)!r})"


@dataclass
class PluginContext:
    """What a plugin may use: the run's flags (read-only), model config, parallel layout and log sinks;
    from the trainer (``bind``, before the first step) this rank's parameters and gradients, lr scaling
    and in-memory rollback."""

    flags: Flags
    model_config: ModelConfig
    parallel: ParallelState
    tensorboard_dir: str | None
    writer: Any = None  # torch.utils.tensorboard.SummaryWriter on the logging rank, else None
    services: PluginServices | None = field(default=None, repr=False)

    def bind(self, services: PluginServices) -> None:
        self.services = services

    def _bound(self, what: str) -> PluginServices:
        if self.services is None:
            raise RuntimeError(f"PluginContext.{what}: no trainer bound yet (it is from the first step on)")
        return self.services

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by name (a pipeline stage's under PP; TP shards where split)."""
        return self._bound("named_parameters").module().named_parameters()

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """In ``before_optimizer_step``: the part of ``param``'s data-parallel-reduced gradient this rank
        owns (ZeRO partitions, TP shards; None when it owns none), so that sums of squares over all ranks
        are exact under any layout. Still multiplied by ``loss_scale()``."""
        return accessors.owned_grad(param, self.parallel.tp_rank, self.parallel.dp_rank)

    def loss_scale(self) -> float:
        """The fp16 loss scale the gradients carry before the step (1 otherwise, and when unbound)."""
        return 1.0 if self.services is None else self.services.loss_scale()

    def scale_lr(self, lr: float = 1.0, warmup: float = 1.0,
                 rewarm: tuple[int, int, float] | None = None) -> None:
        """Request peak and minimum lr times ``lr`` and warmup times ``warmup``, relative to the configured
        schedule, and optionally a second warmup ``rewarm = (start step, steps, start fraction)``; the
        trainer applies the last request after ``after_iteration``, before the next step."""
        self._bound("scale_lr").request_lr_scale(lr, warmup, rewarm)

    def lr(self) -> float:
        """The learning rate of the step about to run."""
        return self._bound("lr").lr()

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        """The optimizer's per-parameter state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``) where the
        optimizer keeps it per module parameter (ZeRO-0 fp32); {} otherwise."""
        return self._bound("optimizer_state").optimizer_state(param)

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        """The first param group's hyperparameters (``betas``, ``eps``, ``weight_decay``, ``lr``)."""
        return self._bound("optimizer_hyperparameters").optimizer_hyperparameters()

    def snapshot(self) -> dict[str, Any]:
        """In ``after_iteration``: this rank's state to continue exactly from here, in host memory (module,
        optimizer, lr schedule, RNG, data position; exact for ZeRO-0 fp32 without PP)."""
        return self._bound("snapshot").snapshot()

    def restore(self, snap: dict[str, Any], skip_data: bool = False) -> None:
        """Return to ``snap``; ``skip_data`` keeps the data position (the window since is not retrained)."""
        self._bound("restore").restore(snap, skip_data)


class Plugin:
    """Base class: override what you need. ``step`` is the 1-based optimizer step about to run
    (0 = a measurement at initialisation before any update)."""

    name = "plugin"
    loss_on_device = False  # True: on_step_end gets the loss as a 0-dim device tensor (no host read)

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

    def before_optimizer_step(self, step: int) -> None:
        """Gradients are reduced across data-parallel ranks, the optimizer has not stepped yet (read them
        with ``self.ctx.owned_grad``)."""

    def on_step_end(self, step: int, loss: Any) -> None:
        """A wanted step finished (detach listeners, reduce across shards, write logs); ``loss`` is a
        float, or a device tensor for a plugin with ``loss_on_device``."""

    def after_iteration(self, iteration: int) -> None:
        """Every optimizer step, after logging/eval/save; ``self.ctx.snapshot()`` / ``self.ctx.restore(s)``
        return to an earlier state in memory, ``self.ctx.scale_lr`` rescales the schedule."""

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
