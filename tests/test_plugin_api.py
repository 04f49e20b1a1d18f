"""The plugin interface (megapost.plugin_api): what it re-exports, the trainer-side services bound through
the Engine protocol (megapost.train.plugin_binding: lr-scale requests applied by the trainer, rollback
hooks, parameter, gradient and optimizer-state access, one clear error before binding) and the model
services (megapost.train.plugin_services) against the model computed directly. The rollback over a real
trainer's state: tests/test_engine.py::test_the_plugins_rollback_restores_the_real_state."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import megapost.plugin_api as api
from megapost.model import LlamaModel, ModelConfig
from megapost.optim.schedule import WarmupDecaySchedule
from megapost.parallel.state import ParallelState
from megapost.plugin_api import Plugin, PluginContext, RunInfo
from megapost.train.plugin_binding import bind_plugins
from megapost.train.plugin_services import Model, model_services

CFG = ModelConfig(vocab_size=16, num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                  seq_length=4, norm_position="post")


def _context() -> PluginContext:
    run = RunInfo(num_layers=2, hidden_size=8, vocab_size=16, norm_position="post", seq_length=4)
    return PluginContext(config=None, run=run, parallel=ParallelState(), services=model_services(CFG))


class _Engine:
    """The Engine members the binding reads, over a real torch module and optimizer (one rank, ZeRO-0)."""

    def __init__(self, module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.module, self.opt = module, opt

    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def owned_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def owned_state(self, param: torch.nn.Parameter, keys: tuple[str, ...]) -> tuple | None:
        state = self.opt.state[param]
        return 0, param.numel(), {k: state[k].detach().reshape(-1).float() for k in keys}


def test_the_api_re_exports_three_names_and_defines_the_rest() -> None:
    tree = ast.parse(Path(api.__file__).read_text(encoding="utf-8"))
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("megapost") for a in node.names}
    assert imported == {"ConfigError", "atomic_path", "atomic_write_text"}
    assert imported < set(api.__all__)


def test_unbound_context_refuses_in_one_line() -> None:
    ctx = _context()
    with pytest.raises(RuntimeError, match=r"PluginContext.scale_lr: no trainer bound yet"):
        ctx.scale_lr(lr=0.5)


def test_lr_request_is_applied_by_the_trainer_side_only() -> None:
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    sched = WarmupDecaySchedule(opt, lr=0.1, min_lr=0.01, warmup=4, decay_iters=20, style="linear")
    for _ in range(6):
        sched.step()
    plugin = Plugin(_context())
    binding = bind_plugins([plugin], _Engine(module, opt), sched)
    plugin.ctx.scale_lr(lr=0.5, warmup=2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 - 0.09 * 2 / 16)  # unchanged so far
    binding.apply_requests()
    # step 6 of a warmup stretched to 8: 0.05 * 7 / 8 (peak 0.1 * 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 7 / 8)
    assert sched.params["min_lr"] == pytest.approx(0.005)
    plugin.ctx.scale_lr()  # back to the configured schedule: (step 6 - warmup 4) / 16 of the decay
    binding.apply_requests()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 - 0.09 * 2 / 16)
    with pytest.raises(RuntimeError, match="not megapost's WarmupDecaySchedule"):
        bind_plugins([plugin], _Engine(module, opt), schedule=None)
        plugin.ctx.scale_lr(lr=0.5)


def test_parameters_gradients_optimizer_state_and_rollback_hooks() -> None:
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(module.parameters(), lr=0.1, betas=(0.8, 0.9), eps=1e-6)
    module(torch.ones(1, 3)).sum().backward()
    calls = []
    plugin = Plugin(_context())
    optimizer = SimpleNamespace(adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6, weight_decay=0.0)
    bind_plugins([plugin], _Engine(module, opt), optimizer=optimizer, snapshot=lambda: {"at": 3},
                 restore=lambda snap, skip: calls.append((snap, skip)))
    assert [n for n, _ in plugin.ctx.named_parameters()] == ["weight", "bias"]
    assert torch.equal(plugin.ctx.owned_grad(module.weight), torch.ones(2, 3))
    assert plugin.ctx.optimizer_state(module.weight) == {}  # no state before the first step
    opt.step()
    state = plugin.ctx.optimizer_state(module.weight)
    assert torch.equal(state["exp_avg_sq"], opt.state[module.weight]["exp_avg_sq"]) and state["step"] == 1.0
    assert plugin.ctx.optimizer_hyperparameters() == {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0,
                                                      "lr": 0.1}
    plugin.ctx.restore(plugin.ctx.snapshot(), skip_data=True)
    assert calls == [({"at": 3}, True)]


def test_forward_probes_are_the_models_attention_and_head() -> None:
    """The attention probabilities from the service against softmax(QK^T/sqrt(d)) computed here from the
    block's own projections (rotary positions: an all-zero key makes every score 0, the causal softmax
    uniform), and the head's input and logits against the model's output."""
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    with torch.no_grad():
        model.layers[1].attention.wk.weight.zero_()
    tokens = torch.randint(0, 16, (2, 4))
    probes = Model(CFG).forward_probes(model, tokens)
    assert len(probes.attention) == 2 and probes.attention[0].shape == (2, 2, 4, 4)
    uniform = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5).unsqueeze(1)
    assert torch.allclose(probes.attention[1], uniform.expand(2, 2, 4, 4))
    assert torch.allclose(probes.attention[0].sum(-1), torch.ones(2, 2, 4))
    with torch.no_grad():
        logits = model(tokens)
    assert torch.equal(probes.logits, logits) and torch.equal(probes.head_weight, model.head.lm_head.weight)
    assert torch.allclose(probes.head_input @ probes.head_weight.T, logits, atol=1e-6)


def test_blocks_and_placement_facts() -> None:
    model = LlamaModel(CFG)
    view = Model(CFG)
    assert [n for n, _ in view.blocks(model)] == [1, 2]
    assert view.ffn_normalises_sum(2)  # Post-Norm normalises the sum after the add
    assert not Model(dataclasses.replace(CFG, norm_position="pre")).ffn_normalises_sum(2)
    seen: list = []
    assert view.listen(model, lambda name, **t: seen.append(name)) > 0
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert ("embed",) in seen and ("layer", 2, "ffn") in [tuple(n) for n in seen]
    assert view.listen(model, None) == view.listen(model, None) > 0
