"""The plugin interface's trainer-side services (megapost.plugin_api.PluginContext bound through
megapost.train.plugin_binding): lr-scale requests applied by the trainer, rollback hooks, parameter and
gradient access, and one clear error before binding."""

from __future__ import annotations

import argparse
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megapost.model import ModelConfig
from megapost.optim.schedule import WarmupDecaySchedule
from megapost.parallel.state import ParallelState
from megapost.plugin_api import Flags, Plugin, PluginContext
from megapost.train.plugin_binding import bind_plugins


def _context() -> PluginContext:
    cfg = ModelConfig(vocab_size=16, num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                      seq_length=4)
    return PluginContext(flags=Flags({}), model_config=cfg, parallel=ParallelState(),
                         tensorboard_dir=None)


def _engine(module: torch.nn.Module) -> SimpleNamespace:
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    sched = WarmupDecaySchedule(opt, lr=0.1, min_lr=0.01, warmup=4, decay_iters=20, style="linear")
    return SimpleNamespace(module=module, optimizer=opt, lr_scheduler=sched, fp16_enabled=lambda: False)


def test_context_flags_are_a_read_only_copy() -> None:
    """A plugin reads every flag by attribute but can change none, and never holds the Namespace."""
    args = argparse.Namespace(collapse_interval=5, train_iters=10)
    ctx = _context()
    ctx.flags = Flags(vars(args))
    flags = ctx.flags
    assert (flags.collapse_interval, flags.get("train_iters"), flags.get("missing", 3)) == (5, 10, 3)
    assert "train_iters" in flags and not isinstance(flags, argparse.Namespace)
    with pytest.raises(AttributeError, match="read-only"):
        flags.collapse_interval = 1
    with pytest.raises(AttributeError, match="read-only"):
        del flags.train_iters
    with pytest.raises(AttributeError, match="no flag 'missing'"):
        _ = flags.missing
    with pytest.raises(TypeError):
        flags._values["collapse_interval"] = 1  # type: ignore[index]
    args.collapse_interval = 7  # the parser's Namespace changing later is not seen
    assert flags.collapse_interval == 5 and copy.deepcopy(flags).collapse_interval == 5


def test_unbound_context_refuses_in_one_line() -> None:
    ctx = _context()
    assert ctx.loss_scale() == 1.0
    with pytest.raises(RuntimeError, match=r"PluginContext.scale_lr: no trainer bound yet"):
        ctx.scale_lr(lr=0.5)


def test_lr_request_is_applied_by_the_trainer_side_only() -> None:
    module = torch.nn.Linear(3, 2)
    engine = _engine(module)
    for _ in range(6):
        engine.lr_scheduler.step()
    plugin = Plugin(_context())
    binding = bind_plugins([plugin], engine)
    plugin.ctx.scale_lr(lr=0.5, warmup=2.0)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 - 0.09 * 2 / 16)  # unchanged so far
    binding.apply_requests()
    # step 6 of a warmup stretched to 8: 0.05 * 7 / 8 (peak 0.1 * 0.5)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 7 / 8)
    assert engine.lr_scheduler.params["min_lr"] == pytest.approx(0.005)
    plugin.ctx.scale_lr()  # back to the configured schedule: (step 6 - warmup 4) / 16 of the decay
    binding.apply_requests()
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 - 0.09 * 2 / 16)


def test_parameters_gradients_and_rollback_hooks() -> None:
    module = torch.nn.Linear(3, 2)
    module(torch.ones(1, 3)).sum().backward()
    calls = []
    plugin = Plugin(_context())
    bind_plugins([plugin], _engine(module), snapshot=lambda: {"at": 3},
                 restore=lambda snap, skip: calls.append((snap, skip)))
    names = [n for n, _ in plugin.ctx.named_parameters()]
    assert names == ["weight", "bias"]
    grad = plugin.ctx.owned_grad(module.weight)  # one rank, no ZeRO: the full .grad
    assert torch.equal(grad, torch.ones(2, 3)) and math.isclose(plugin.ctx.loss_scale(), 1.0)
    plugin.ctx.restore(plugin.ctx.snapshot(), skip_data=True)
    assert calls == [({"at": 3}, True)]
