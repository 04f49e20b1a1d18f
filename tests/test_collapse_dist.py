"""Shard reductions on 2 gloo ranks equal the single-process values: a sequence split (tensor parallelism
with sequence parallelism, probes see [b, s/2, d] shards), tensor parallelism without it (replicated
residual stream, counted once), and a batch split (data parallelism). The model is megapost's real
tensor-parallel one; the step is driven by hand (plain SGD, data-parallel gradients averaged by hand)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from collapse_helpers import assert_close, make_plugin, random_batches, records_by_key, run_step, small_config
from dist_utils import run_ranks

from megapost.model import LlamaModel
from megapost.parallel.collectives import counting_comm

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

STEPS = (1, 2)
LAYER_FIELDS = ("t_sim_x", "t_sim_y", "t_sim_out", "resid_norm", "rms_factor_mean", "rms_factor_min",
                "rms_factor_max", "alpha", "c", "grad_norm", "grad_norm_layer", "grad_norm_norms")
STEP_FIELDS = ("freq_loss_agg", "freq_loss_seq", "freq_loss_running", "t_sim_embed", "t_sim_head")


def average_grads(model: torch.nn.Module, group) -> None:
    """What the engine's data-parallel reduction does before the optimizer step."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)


def measure(tp: int, sp: bool, norm: str) -> dict | None:
    """On every rank: two measured SGD steps of the layout; the logging rank returns its records."""
    from megapost.parallel import build_model, initialize_parallel

    pstate = initialize_parallel(tp, 1, sp)
    cfg = small_config(norm)
    model, loss_fn = build_model(cfg, pstate)
    plugin = make_plugin(cfg, pstate=pstate)
    plugin.on_model_built(model)
    collectives = []
    on_step_end = plugin.on_step_end

    def counted(step: int, loss: float) -> None:
        with counting_comm() as stats:
            on_step_end(step, loss)
        collectives.append(dict(stats.calls))

    plugin.on_step_end = counted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in STEPS:
        mine = random_batches(cfg, 2, batch=2, seed=step)[pstate.dp_rank::pstate.dp_size]
        grads = partial(average_grads, model, pstate.dp_group) if pstate.dp_size > 1 else None
        run_step(plugin, model, step, mine, opt, loss_fn=loss_fn, on_grads=grads)
        out.append(plugin.last)
    return {"records": out, "collectives": collectives} if pstate.is_logging_rank else None


def single(norm: str) -> list[dict]:
    cfg = small_config(norm)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in STEPS:
        run_step(plugin, model, step, random_batches(cfg, 2, batch=2, seed=step), opt)
        out.append(plugin.last)
    return out


@pytest.mark.parametrize(("tp", "sp", "norm", "collectives"), [
    (2, True, "post", {"all_reduce": 3}),  # sequence split: partials over TP, then the buffer's sum and max
    (2, False, "pre", {"all_reduce": 2}),  # replicated residual stream
    (1, False, "post", {"all_reduce": 2}),  # batch split (data parallelism)
])
def test_two_ranks_match_one_process(tp, sp, norm, collectives):
    ranks = run_ranks(measure, 2, tp, sp, norm)
    result = ranks[-1]
    assert result["collectives"] == [collectives] * len(STEPS)
    for got, want in zip(result["records"], single(norm), strict=True):
        got_layers, want_layers = records_by_key(got["layers"]), records_by_key(want["layers"])
        for key, rec in want_layers.items():
            for field in LAYER_FIELDS:
                assert_close(got_layers[key][field], rec[field], 2e-5, f"step {want['step']} {key} {field}")
        for field in STEP_FIELDS + (("loss",) if tp > 1 else ()):
            assert_close(got["step_record"][field], want["step_record"][field], 2e-5, field)
