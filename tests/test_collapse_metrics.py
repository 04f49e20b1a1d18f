"""Collapse metrics against brute force on a 3-layer d=32 model (every norm placement and --qk-norm; MHA and
GQA), one process."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from collapse_helpers import (
    assert_close,
    grad_norms,
    make_plugin,
    random_batches,
    records_by_key,
    reference,
    run_step,
    small_config,
)
from collapse_metrics.similarity import tsim
from collapse_metrics.table import parse_layers
from torch.utils.checkpoint import checkpoint

from megapost.model import LlamaModel, Probe, lm_loss, set_listener
from megapost.model.placements import PLACEMENTS
from megapost.parallel.activation_checkpoint import checkpoint_without_probes, silent_listener

FIELDS = ("t_sim_x", "t_sim_y", "t_sim_out", "resid_norm", "rms_factor_mean", "rms_factor_min",
          "rms_factor_max", "alpha", "c")


def check_against_reference(plugin, ref, grads=None, rel=1e-5, skip=()):
    records = records_by_key(plugin.last["layers"])
    for key, expected in ((k, v) for k, v in ref.items() if isinstance(k, tuple)):
        for field in FIELDS:
            if field not in skip:
                assert_close(records[key][field], expected[field], rel, f"{key} {field}")
    if grads is not None:
        for (layer, k), rec in records.items():
            g = grads[layer]
            assert_close(rec["grad_norm"], g[("attn", "ffn")[k]], rel, f"L{layer} grad {k}")
            assert_close(rec["grad_norm_layer"], g["layer"], rel, f"L{layer} grad layer")
            assert_close(rec["grad_norm_norms"], g["norms"], rel, f"L{layer} grad norms")
    step = plugin.last["step_record"]
    assert_close(step["t_sim_embed"], ref["embed"], rel, "t_sim embed")
    assert_close(step["t_sim_head"], ref["head"], rel, "t_sim head")


@pytest.mark.parametrize("norm, groups", [("post", None), ("pre", None), ("post", 2), ("pre", 1)])
def test_step_matches_brute_force(norm, groups):
    cfg = small_config(norm, num_query_groups=groups)  # groups: grouped-query attention (probes unchanged)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg)
    plugin.on_model_built(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):  # the second step checks the buffer is reset between steps
        batches = random_batches(cfg, 3, batch=2, seed=step)
        ref = reference(model, batches)
        grads = {}
        loss = run_step(plugin, model, step, batches, opt,
                        on_grads=lambda g=grads: g.update(grad_norms(model)))
        check_against_reference(plugin, ref, grads)
        assert plugin.last["step_record"]["loss"] == pytest.approx(loss, rel=1e-12)
    if norm == "pre":
        assert all(r["t_sim_out"] is None for r in plugin.last["layers"])
    alphas = [r["alpha"] for r in plugin.last["layers"]]
    assert all(a is not None and 0 < a < 10 for a in alphas)


# (placement, config changes): every placement, the mixed one both with a Pre tail and all-Post, and the
# QK-norm stabiliser on a post-style, a pre-style and the DyT layout
PLACEMENT_CASES = [(p, {}) for p in PLACEMENTS if p != "mix"] + [
    ("mix", {"mix_post_fraction": 0.5}), ("mix", {"mix_post_fraction": 1.0}),
    ("post", {"qk_norm": True}), ("sandwich", {"qk_norm": True}), ("dyt", {"qk_norm": True})]
# where a quantity is null by definition (docs/placements.md): sublayer -> fields, per placement
NO_OUT = ("t_sim_out",)
NO_RMS = ("rms_factor_mean", "rms_factor_min", "rms_factor_max", "c")
DOCUMENTED_NULLS = {
    "post": {}, "deepnorm": {},
    "pre": {"attn": NO_OUT, "ffn": NO_OUT}, "sandwich": {"attn": NO_OUT, "ffn": NO_OUT},
    "pre-scaled": {"attn": NO_OUT, "ffn": NO_OUT},
    "hybrid": {"ffn": NO_OUT + NO_RMS},
    "dyt": {"attn": NO_OUT + NO_RMS, "ffn": NO_OUT + NO_RMS},
}


def documented_nulls(cfg, layer, sublayer):
    if cfg.norm_position == "mix":  # Post-Norm layers 1..floor(rho L), Pre-Norm after
        post = layer <= math.floor(cfg.mix_post_fraction * cfg.num_layers)
        return () if post else NO_OUT
    return DOCUMENTED_NULLS[cfg.norm_position].get(sublayer, ())


CASE_IDS = [f"{p}-{'-'.join(f'{k}={v}' for k, v in c.items())}" for p, c in PLACEMENT_CASES]


@pytest.mark.parametrize("norm, changes", PLACEMENT_CASES, ids=CASE_IDS)
def test_every_placement_matches_brute_force(norm, changes):
    """One measured step of each placement against the papers' dataflow computed by hand: t_sim of X, Y
    and the normalised output, the RMS factor, alpha, c, grad norms per group; null exactly where
    documented. Only post-style last layers arm the early warning."""
    cfg = small_config(norm, **changes)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg, "--collapse-early-warning")
    plugin.on_model_built(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_step(plugin, model, 1, random_batches(cfg, 1, seed=7), opt)  # gains and DyT scalars move off init
    batches = random_batches(cfg, 2, batch=2, seed=8)
    ref = reference(model, batches)
    grads = {}
    run_step(plugin, model, 2, batches, opt, on_grads=lambda: grads.update(grad_norms(model)))
    check_against_reference(plugin, ref, grads)
    assert "other" not in plugin.params.groups  # every block parameter is in attn, ffn or norms
    for rec in plugin.last["layers"]:
        nulls = documented_nulls(cfg, rec["layer"], rec["sublayer"])
        for field in FIELDS:
            what = (rec["layer"], rec["sublayer"], field, rec[field])
            assert (rec[field] is None) == (field in nulls), what
        assert rec["grad_norm_norms"] > 0
    armed = norm in ("post", "deepnorm") or changes.get("mix_post_fraction") == 1.0
    assert (plugin.warning is not None) == armed
    assert (plugin.last["step_record"]["early_warning"] is None) == (not armed)
    assert isinstance(plugin.last["step_record"]["collapsed"], bool)


def test_z_loss_enters_the_gradients_not_the_loss():
    """--z-loss: alpha and the grad norms follow the gradient of CE + coef log^2 Z; the loss beside the
    frequency loss stays the cross-entropy."""
    cfg = small_config("sandwich")
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg)
    batches = random_batches(cfg, 2, batch=2, seed=9)
    z_fn = partial(lm_loss, z_loss=0.5)
    ref, plain = reference(model, batches, z_fn), reference(model, batches)
    with torch.no_grad():
        ce = sum(float(lm_loss(model(b["tokens"]), b["labels"], b["loss_mask"])) for b in batches) / 2
    grads = {}
    run_step(plugin, model, 1, batches, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=z_fn,
             on_grads=lambda: grads.update(grad_norms(model)))
    check_against_reference(plugin, ref, grads)
    assert plugin.last["step_record"]["loss"] == pytest.approx(ce, rel=1e-6)
    head = records_by_key(plugin.last["layers"])[(cfg.num_layers, 1)]["alpha"]
    assert abs(head - plain[(cfg.num_layers, 1)]["alpha"]) > 1e-4 * head  # the z-term moved the gradient


def _blockwise(model, tokens, wrap):
    x = model.embedding(tokens)
    for block in model.layers:
        x = wrap(block, x)
    return model.head(x)


CHECKPOINTS = {  # name: (checkpoint function of the model, do probes fire again during recompute)
    "non-reentrant, probes fire in recompute": (lambda m: partial(checkpoint, use_reentrant=False), True),
    "reentrant, no-grad pass + recompute": (lambda m: partial(checkpoint, use_reentrant=True), True),
    "megapost checkpoint_without_probes": (lambda m: partial(checkpoint_without_probes, m), False),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_activation_checkpointing_counts_each_micro_batch_once(kind):
    cfg = small_config("post")
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    batches = random_batches(cfg, 2, batch=2, seed=3)
    ref = reference(model, batches)
    plugin = make_plugin(cfg)
    make_wrap, repeated = CHECKPOINTS[kind]
    wrap = make_wrap(model)
    calls = []
    for probe in model.layers[1].modules():
        if isinstance(probe, Probe):
            probe.register_forward_pre_hook(  # a recompute's silent listener reports nothing
                lambda m, args, kwargs: calls.append(m.listener not in (None, silent_listener)),
                with_kwargs=True)
    run_step(plugin, model, 1, batches, torch.optim.SGD(model.parameters(), lr=0.0),
             forward=partial(_blockwise, model, wrap=lambda block, x: wrap(block, x)))
    forwards = 2 * len(batches)  # two probes of layer 2 per micro-batch
    assert sum(calls) > forwards if repeated else sum(calls) == forwards
    check_against_reference(plugin, ref)


def test_probe_without_grad_on_x_and_bf16():
    cfg = small_config("post")
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(torch.bfloat16)
    model.embedding.word_embeddings.weight.requires_grad_(False)  # X_1^1 does not require grad
    batches = random_batches(cfg, 2, batch=2, seed=4)
    ref = reference(model, batches)
    plugin = make_plugin(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    run_step(plugin, model, 1, batches, torch.optim.SGD(trainable, lr=0.0))
    records = records_by_key(plugin.last["layers"])
    assert records[(1, 0)]["alpha"] is None and records[(1, 0)]["c"] is None
    # same bf16 activations, fp32 vs fp64 accumulation; alpha pools bf16 gradients of a bf16 backward
    rest = {k: v for k, v in ref.items() if k != (1, 0)}
    check_against_reference(plugin, rest, rel=1e-4, skip=("alpha", "c"))
    for key, expected in ref.items():
        if isinstance(key, tuple) and key != (1, 0):
            assert_close(records[key]["alpha"], expected["alpha"], 2e-2, f"{key} alpha (bf16)")


def test_forward_only_step_zero_and_interval():
    cfg = small_config("post")
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg, "--collapse-at-init", "--collapse-interval", "3", "--collapse-layers", "1,3")
    assert [s for s in range(8) if plugin.wants_step(s)] == [0, 3, 6]
    assert not make_plugin(cfg).wants_step(0)
    batches = random_batches(cfg, 2, seed=5)
    ref = reference(model, batches)
    run_step(plugin, model, 0, batches, optimizer=None)
    assert {r["layer"] for r in plugin.last["layers"]} == {1, 3}
    check_against_reference(plugin, {k: v for k, v in ref.items() if not isinstance(k, tuple) or k[0] != 2},
                            skip=("alpha", "c"))
    assert all(r[f] is None for r in plugin.last["layers"] for f in ("alpha", "c", "grad_norm"))
    # unmeasured step: nothing attached, no hooks
    probes = [m for m in model.modules() if isinstance(m, Probe)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    last = plugin.last
    run_step(plugin, model, 1, batches, opt)
    assert plugin.last is last and all(p.listener is None for p in probes)
    run_step(plugin, model, 3, batches, opt)
    assert plugin.last["step"] == 3 and all(p.listener is None for p in probes)
    assert set_listener(model, None) == len(probes)


def test_frequency_losses_on_hand_made_labels():
    cfg = small_config("post", seq_length=16)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    plugin = make_plugin(cfg)
    ones = torch.ones(1, 16)
    tokens = torch.zeros(1, 16, dtype=torch.long)

    def batch(labels):
        return {"tokens": tokens, "labels": torch.tensor([labels]), "loss_mask": ones}

    step1 = [batch([3] * 16), batch([4] * 8 + [5] * 8)]  # H = 0 and ln 2; pooled 16:8:8
    step2 = [batch([6] * 16), batch([7] * 16)]  # pooled 16:16
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ln2 = math.log(2)
    run_step(plugin, model, 1, step1, opt)
    rec = plugin.last["step_record"]
    assert rec["freq_loss_agg"] == pytest.approx(1.5 * ln2)
    assert rec["freq_loss_seq"] == pytest.approx(ln2 / 2)
    assert rec["freq_loss_running"] == pytest.approx(1.5 * ln2)
    run_step(plugin, model, 2, step2, opt)
    rec = plugin.last["step_record"]
    assert rec["freq_loss_agg"] == pytest.approx(ln2)
    assert rec["freq_loss_seq"] == pytest.approx(0.0)
    assert rec["freq_loss_running"] == pytest.approx(2.25 * ln2)  # 16:8:8:16:16 of 64
    resumed = make_plugin(cfg)
    resumed.load_state_dict(plugin.state_dict())
    assert resumed.running.value() == pytest.approx(2.25 * ln2)


def test_tsim_and_layer_parsing():
    x = torch.randn(2, 5, 8)
    assert float(tsim(x.mean(1, keepdim=True).expand(2, 5, 8))[0]) == pytest.approx(1.0)
    eye = torch.eye(8)[:5]  # orthogonal rows: t_sim = 1/n
    assert float(tsim(eye)) == pytest.approx(1 / 5)
    assert parse_layers("1,2,47-48", 48) == (1, 2, 47, 48)
    assert parse_layers("", 3) == (1, 2, 3)
    for bad in ("0", "2-1", "a", "49"):
        with pytest.raises(ValueError):
            parse_layers(bad, 48)
