"""The plugin interface: the one module of megapost a plugin imports, and discovery through the
``megapost.plugins`` entry-point group.

The trainer never imports a plugin; it calls ``Plugin``'s methods at fixed points. On steps for which
``wants_step`` is False nothing else is called, so a plugin costs nothing there. A plugin sees the run
through its ``PluginContext``: its own typed config (``Plugin.config_class``, parsed from the flags its
``add_arguments`` registers), what it may know of the run (``RunInfo``), the rank's layout, and services
given as protocols (dataset reader, collectives, the model's sublayers, the collapse law; once the trainer
is built, parameters, owned gradients, lr scaling and in-memory rollback). It never sees the Trainer, the
engine, megapost's model classes or the parser's Namespace. The implementations live in
``megapost.train.plugin_services`` and ``megapost.train.plugin_binding``.

Besides its own classes this module re-exports three names: ``ConfigError`` (a plugin's bad flag is one
line, as megapost's) and the atomic writers ``atomic_path`` / ``atomic_write_text`` (import-linter's
plugin contract names these two imports as its only exceptions).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_path, atomic_write_text

__all__ = [
    "ENTRY_POINT_GROUP", "CollapseLaw", "Collectives", "ConfigError", "DatasetReader", "ForwardProbes",
    "InitModels", "Layout", "ModelView", "Plugin", "PluginContext", "RunInfo", "Services", "TrainerServices",
    "atomic_path", "atomic_write_text", "available_plugins", "plugin_classes",
]

ENTRY_POINT_GROUP = "megapost.plugins"


@dataclass(frozen=True)
class RunInfo:
    """What a plugin may know of the run, typed (from megapost's resolved config)."""

    num_layers: int
    hidden_size: int
    vocab_size: int  # padded, as the model's
    norm_position: str
    seq_length: int
    train_iters: int = 0
    lr: float = 0.0
    lr_warmup_iters: int = 0
    zero_stage: int = 0  # as the engine runs it
    bf16: bool = False
    pipeline_model_parallel_size: int = 1


class Layout(Protocol):
    """This rank's place in the parallel layout (megapost.parallel.state.ParallelState)."""

    tp_rank: int
    dp_rank: int
    world_size: int
    sequence_parallel: bool
    tp_group: Any

    @property
    def is_logging_rank(self) -> bool: ...

    @property
    def is_last_stage(self) -> bool: ...


class Collectives(Protocol):
    """Autograd-safe collectives over a process group (None: the world); the input on one rank."""

    def sum(self, x: torch.Tensor, group: Any = None) -> torch.Tensor: ...

    def max(self, x: torch.Tensor, group: Any = None) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """The ranks' ``x`` concatenated along dim 0, in rank order."""


class DatasetReader(Protocol):
    """The run's corpus (its first --data-path prefix): where it is and its train split's tokens."""

    prefix: str | None  # None: no indexed dataset (e.g. a benchmark's own batches)
    split: str
    cache_dir: str | None

    def train_tokens(self) -> np.ndarray:
        """The train split's tokens, documents concatenated (a memory map: read it in chunks)."""


@dataclass
class ForwardProbes:
    """One no-grad forward's internals a plugin may read: per layer the causal attention probabilities
    [b, heads, s, s] (fp32), the LM head's input X^H, the logits and the head's weight."""

    attention: list[torch.Tensor]
    head_input: torch.Tensor
    logits: torch.Tensor
    head_weight: torch.Tensor


class ModelView(Protocol):
    """The model as a plugin needs it, without its classes: probes, blocks, placement facts."""

    def listen(self, module: nn.Module, listener: Any) -> int:
        """Attach ``listener`` (None: detach) to every probe under ``module``; returns their count. A
        listener is called ``listener(name, **tensors)``: ("embed",) with x; ("layer", l, "attn"/"ffn")
        with x, y (and out where the rule normalises the sum); ("head",) with x."""

    def blocks(self, module: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        """(1-based layer number, block) of each transformer block under ``module``."""

    def ffn_normalises_sum(self, layer: int) -> bool:
        """Whether layer ``layer``'s FFN normalises its residual sum after the add (Post-Norm's rule)."""

    def forward_probes(self, module: nn.Module, tokens: torch.Tensor) -> ForwardProbes:
        """A no-grad forward of ``tokens`` [b, s] read at its attention and head."""


class CollapseLaw(Protocol):
    """The fitted collapse law (megapost.study.boundary_law) for this run."""

    def load(self, path: str | None, flag: str) -> tuple[Any, str]:
        """(law, where it came from), or (None, why there is none). A law has ``placement``, ``sigma`` and
        ``predict(factors)`` (lr_star, interval, lr_at(p, sigma), extrapolated, not_modelled)."""

    def run_factors(self) -> dict[str, float]:
        """This run's factors (width, depth, warmup, tokens per step, ...) as the law reads them."""


class InitModels(Protocol):
    """Untrained models and real sequences for analyses at initialisation, outside a run (the plugin's
    Stage I; megapost.train.plugin_services.InitModels)."""

    def untrained_forward(self, cfg: Any, tokens: torch.Tensor, dtype: torch.dtype, listener: Any) -> None:
        """The untrained model of ``cfg`` (megapost's ModelConfig) in ``dtype``, each sequence of ``tokens``
        [S, n] through its embedding and blocks (no head, no grad), ``listener`` on its probes."""

    def init_std(self, cfg: Any, role: str) -> float:
        """The init std of a weight matrix of ``cfg``'s model by role (embed, qkv, wo, w1, w3, w2)."""

    def sequences(self, data_path: str, seq_length: int, count: int, seed: int = 1234) -> torch.Tensor:
        """``count`` token sequences [count, seq_length] of an indexed dataset, cut and shuffled as
        the trainer's dataset does."""


@dataclass(frozen=True)
class Services:
    """What every plugin context offers from construction on."""

    model: ModelView
    collectives: Collectives
    data: DatasetReader
    law: CollapseLaw


class TrainerServices(Protocol):
    """What the trainer lends a bound context (megapost.train.plugin_binding), through its Engine."""

    def module(self) -> nn.Module: ...

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, snap: dict[str, Any], skip_data: bool) -> None: ...

    def request_lr_scale(self, lr: float, warmup: float, rewarm: tuple[int, int, float] | None) -> None: ...

    def lr(self) -> float: ...

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]: ...

    def optimizer_hyperparameters(self) -> dict[str, Any]: ...


@dataclass
class PluginContext:
    """What a plugin may use: its own config, the run, this rank's layout, the services and log sinks;
    from the trainer (``bind``, before the first step) parameters, gradients, lr scaling and rollback."""

    config: Any  # the plugin's own config_class instance (None without one)
    run: RunInfo
    parallel: Layout
    services: Services
    tensorboard_dir: str | None = None
    writer: Any = None  # torch.utils.tensorboard.SummaryWriter on the logging rank, else None
    trainer: TrainerServices | None = field(default=None, repr=False)

    def bind(self, trainer: TrainerServices) -> None:
        self.trainer = trainer

    def _bound(self, what: str) -> TrainerServices:
        if self.trainer is None:
            raise RuntimeError(f"PluginContext.{what}: no trainer bound yet (it is from the first step on)")
        return self.trainer

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by name (a pipeline stage's under PP; TP shards where split)."""
        return self._bound("named_parameters").module().named_parameters()

    def owned_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """In ``before_optimizer_step``: the part of ``param``'s data-parallel-reduced gradient this rank
        owns (ZeRO partitions, TP shards; None when it owns none), so that sums of squares over all ranks
        are exact under any layout."""
        return self._bound("owned_grad").owned_grad(param)

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
        """The optimizer's state of ``param`` shaped as it (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``)
        where this rank keeps all of it (ZeRO-0 fp32); {} otherwise."""
        return self._bound("optimizer_state").optimizer_state(param)

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        """``betas``, ``eps``, ``weight_decay`` and the ``lr`` of the step about to run."""
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
    config_class: type | None = None  # a dataclass whose fields are the dests of add_arguments' flags

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Register the plugin's own flags (called before parsing), in its own argument group."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    def on_model_built(self, model: nn.Module) -> None:
        """``model``: this rank's module (a pipeline stage under PP), before the engine wraps it."""

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
