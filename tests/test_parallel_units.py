"""Mappings, parallel layers and vocab-parallel CE on 2 gloo ranks against single-process math; layout
validation and vocab padding without a process group."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from dist_utils import ProbeCounter, run_ranks, tiny_config
from torch import nn

from megapost.model import LlamaModel, lm_loss, set_listener
from megapost.parallel import (
    ParallelState,
    build_model,
    deepspeed_config_errors,
    deepspeed_config_overrides,
    initialize_parallel,
    layout_errors,
    padded_vocab_size,
    validate_layout,
)
from megapost.parallel.pipeline import model_parameter_name

TOL = 1e-6
WORLD = 2


def _data(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def _check_mappings(rank: int, group: object) -> dict[str, float]:
    """Each mapping's forward and backward against the math on all ranks' inputs/gradients."""
    from megapost.parallel import mappings as M

    xs = [_data(2, 4, 6, seed=10 + r) for r in range(WORLD)]  # per-rank inputs
    gs = [_data(2, 4, 6, seed=20 + r) for r in range(WORLD)]  # per-rank upstream grads
    full = _data(2, 4, 6, seed=30)  # a replicated input
    chunk = lambda t, dim: t.chunk(WORLD, dim)[rank]
    cat = torch.cat
    own = lambda ts, dim: [t.chunk(WORLD, dim)[r] for r, t in enumerate(ts)]  # rank r's shard of ts[r]
    # name: (fn, input on this rank, grads per rank (shaped as the output), expected output, expected dx)
    cases: dict[str, tuple[Callable, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]] = {
        "copy": (M.copy_to_tp_region, xs[rank], gs, xs[rank], sum(gs)),
        "reduce": (M.reduce_from_tp_region, xs[rank], gs, sum(xs), gs[rank]),
        "scatter_tp": (M.scatter_to_tp_region, full, own(gs, -1), chunk(full, -1), cat(own(gs, -1), -1)),
        "gather_tp": (M.gather_from_tp_region, own(xs, -1)[rank], gs, cat(own(xs, -1), -1),
                      chunk(gs[rank], -1)),
        "scatter_seq": (M.scatter_to_sequence_region, full, own(gs, 1), chunk(full, 1), cat(own(gs, 1), 1)),
        "gather_seq": (M.gather_from_sequence_region, own(xs, 1)[rank], gs, cat(own(xs, 1), 1),
                       chunk(sum(gs), 1)),
        "reduce_scatter_seq": (M.reduce_scatter_to_sequence_region, xs[rank], own(gs, 1), chunk(sum(xs), 1),
                               cat(own(gs, 1), 1)),
    }
    errors = {}
    for name, (fn, x, grads, want_out, want_dx) in cases.items():
        x = x.clone().requires_grad_(True)
        out = fn(x, group)
        out.backward(grads[rank])
        errors[f"{name}.forward"] = _err(out, want_out)
        errors[f"{name}.backward"] = _err(x.grad, want_dx)
    return errors


def _check_layers(rank: int, group: object) -> dict[str, float]:
    """Column/row/embedding layers against nn.Linear/nn.Embedding (outputs and all gradients)."""
    from megapost.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(0)
    full = nn.Linear(16, 8, bias=True)
    x_full = _data(2, 4, 16, seed=1)
    g_full = _data(2, 4, 8, seed=2)
    chunk = lambda t, dim: t.chunk(WORLD, dim)[rank]

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        full.zero_grad()
        x = x_full.clone().requires_grad_(True)
        y = full(x)
        y.backward(g_full)
        return y.detach(), x.grad

    y_ref, dx_ref = reference()
    dw, db = full.weight.grad.clone(), full.bias.grad.clone()
    errors = {}

    # name: (layer, input on this rank, upstream grad on this rank, out want, dx want, (dW, dB) want)
    cases = {
        "column_gather": (ColumnParallelLinear(full, group, "copy", gather_output=True), x_full, g_full,
                          y_ref, dx_ref, (chunk(dw, 0), chunk(db, 0))),
        "column": (ColumnParallelLinear(full, group, "copy"), x_full, chunk(g_full, -1), chunk(y_ref, -1),
                   dx_ref, (chunk(dw, 0), chunk(db, 0))),
        "column_seq": (ColumnParallelLinear(full, group, "gather_seq"), chunk(x_full, 1), chunk(g_full, -1),
                       chunk(y_ref, -1), chunk(dx_ref, 1), (chunk(dw, 0), chunk(db, 0))),
        "row": (RowParallelLinear(full, group, input_is_parallel=False), x_full, g_full, y_ref, dx_ref,
                (chunk(dw, 1), db)),
        "row_seq": (RowParallelLinear(full, group, sequence_parallel=True), chunk(x_full, -1),
                    chunk(g_full, 1), chunk(y_ref, 1), chunk(dx_ref, -1), (chunk(dw, 1), db)),
    }
    for name, (layer, x, g, want_y, want_dx, (want_dw, want_db)) in cases.items():
        x = x.clone().requires_grad_(True)
        y = layer(x)
        y.backward(g)
        errors[f"{name}.forward"] = _err(y, want_y)
        errors[f"{name}.dx"] = _err(x.grad, want_dx)
        errors[f"{name}.dweight"] = _err(layer.weight.grad, want_dw)
        errors[f"{name}.dbias"] = _err(layer.bias.grad, want_db)
        assert layer.weight.tensor_model_parallel and layer.weight.partition_stride == 1

    emb = nn.Embedding(32, 8)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    g = _data(2, 6, 8, seed=4)
    emb.weight.grad = None
    emb(ids).backward(g)
    for name, sp, g_local in (("embedding", False, g), ("embedding_seq", True, chunk(g, 1))):
        layer = VocabParallelEmbedding(emb, group, sequence_parallel=sp)
        y = layer(ids)
        y.backward(g_local)
        want = emb(ids).detach()
        errors[f"{name}.forward"] = _err(y, chunk(want, 1) if sp else want)
        errors[f"{name}.dweight"] = _err(layer.weight.grad, chunk(emb.weight.grad, 0))
    return errors


def _check_cross_entropy(rank: int, group: object) -> dict[str, float]:
    from megapost.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_lm_loss

    logits = _data(3, 5, 32, seed=5) * 4
    target = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(6))
    mask = (torch.rand(3, 5, generator=torch.Generator().manual_seed(7)) > 0.3).float()
    weights = _data(3, 5, seed=8)
    chunk = lambda t: t.chunk(WORLD, -1)[rank]

    full = logits.clone().requires_grad_(True)
    ce_ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    (ce_ref * weights).sum().backward()
    local = chunk(logits).clone().requires_grad_(True)
    ce = vocab_parallel_cross_entropy(local, target, group)
    (ce * weights).sum().backward()
    errors = {"ce.forward": _err(ce, ce_ref.detach()), "ce.backward": _err(local.grad, chunk(full.grad))}

    full.grad = None
    loss_ref = lm_loss(full, target, mask)
    loss_ref.backward()
    local = chunk(logits).clone().requires_grad_(True)
    loss = vocab_parallel_lm_loss(local, target, mask, group)
    loss.backward()
    errors["lm_loss.forward"] = abs(float(loss) - float(loss_ref))
    errors["lm_loss.backward"] = _err(local.grad, chunk(full.grad))

    # z-loss: the value stays the CE, the gradient is that of CE + coef * mean(log^2 Z), written out
    from test_placements import naive_z_loss_objective

    full = logits.clone().requires_grad_(True)  # lm_loss's backward above rewrote fp32 logits in place
    plain, objective = naive_z_loss_objective(full, target, mask, 1e-2)
    objective.backward()
    local = chunk(logits).clone().requires_grad_(True)
    loss = vocab_parallel_lm_loss(local, target, mask, group, z_loss=1e-2)
    loss.backward()
    errors["z_loss.forward"] = abs(float(loss) - float(plain))
    errors["z_loss.backward"] = _err(local.grad, chunk(full.grad))
    return errors


def unit_checks() -> dict[str, float]:
    """Runs on every rank: max abs error per check, for the native and the fallback collectives."""
    import torch.distributed as dist

    from megapost.parallel import collectives

    group = dist.new_group(list(range(WORLD)))
    rank = dist.get_rank()
    errors = {}
    for fallback in (False, True):
        collectives.FORCE_FALLBACK = fallback
        suffix = " [fallback]" if fallback else ""
        for check in (_check_mappings, _check_layers, _check_cross_entropy):
            errors.update({k + suffix: v for k, v in check(rank, group).items()})
    collectives.FORCE_FALLBACK = False
    return errors


@pytest.mark.integration
def test_mappings_layers_and_cross_entropy_on_two_ranks() -> None:
    results = run_ranks(unit_checks, WORLD)
    worst = {name: max(r[name] for r in results) for name in results[0]}
    bad = {name: err for name, err in worst.items() if err > TOL}
    assert not bad, bad
    assert len(worst) == 2 * (14 + 24 + 6)  # native and fallback collectives


def test_padded_vocab_size_rounds_to_divisible_by_only() -> None:
    assert padded_vocab_size(256, 128) == 256
    assert padded_vocab_size(257, 128) == 384
    assert padded_vocab_size(32000, 128) == 32000
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(50257, 1) == 50257
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        padded_vocab_size(100, 0)


@pytest.mark.parametrize("kwargs, flags", [
    (dict(tp=3, world_size=6), ["--num-attention-heads 4", "--ffn-hidden-size 128",
                                "padded vocab size 256", "--make-vocab-size-divisible-by"]),
    (dict(tp=2, world_size=6, pp=2), ["world size 6", "--tensor-model-parallel-size 2",
                                      "--pipeline-model-parallel-size 2"]),
    (dict(pp=8, world_size=8), ["--num-layers 4", "--pipeline-model-parallel-size 8"]),
    (dict(tp=2, world_size=2, sequence_parallel=True, seq_length=33),
     ["--seq-length 33", "--sequence-parallel"]),
])
def test_impossible_layouts_name_the_flags(kwargs: dict, flags: list[str]) -> None:
    args = dict(tp=1, pp=1, sequence_parallel=False, seq_length=32) | kwargs
    cfg = tiny_config()
    errors = layout_errors(cfg, **args)
    text = "\n".join(errors)
    for flag in flags:
        assert flag in text, (flag, text)
    with pytest.raises(ValueError, match="invalid parallel layout"):
        validate_layout(cfg, **args)


def test_possible_layouts_pass() -> None:
    cfg = tiny_config()
    for tp, pp, world in ((1, 1, 1), (2, 1, 2), (2, 2, 8), (4, 4, 16), (1, 4, 4)):
        validate_layout(cfg, tp, pp, True, 32, world)


def test_initialize_parallel_without_process_group() -> None:
    with pytest.raises(ValueError, match="world size 1 is not divisible by --tensor-model-parallel-size 2"):
        initialize_parallel(tp=2)
    state = initialize_parallel()
    assert (state.tp_size, state.pp_size, state.dp_size, state.tp_group) == (1, 1, 1, None)


def test_deepspeed_config_checks() -> None:
    pp_sp = ParallelState(tp_size=2, pp_size=2, sequence_parallel=True)
    fp32_zero0 = {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0}
    assert any("--zero-stage 1" in e for e in deepspeed_config_errors(pp_sp, fp32_zero0))
    zero1 = {"zero_optimization": {"stage": 1}}
    assert any("pipe_partitioned" in e for e in deepspeed_config_errors(pp_sp, zero1))
    good = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0} | deepspeed_config_overrides(pp_sp)
    assert deepspeed_config_errors(pp_sp, good) == []
    assert deepspeed_config_errors(ParallelState(tp_size=2), fp32_zero0) == []
    no_reentrant = good | {"pipeline": {**good["pipeline"], "use_reentrant": False}}
    assert any("use_reentrant" in e for e in deepspeed_config_errors(pp_sp, no_reentrant))
    assert deepspeed_config_overrides(ParallelState(tp_size=2, pp_size=2)) == {}


def test_pipeline_parameter_names_map_to_model_names() -> None:
    assert model_parameter_name("0.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"
    assert model_parameter_name("1.attention.wq.weight", 4) == "layers.0.attention.wq.weight"
    assert model_parameter_name("4.mlp.w2.weight", 4) == "layers.3.mlp.w2.weight"
    assert model_parameter_name("5.lm_head.weight", 4) == "head.lm_head.weight"


def test_single_process_build_is_the_plain_model_and_checkpointing_reports_once() -> None:
    """(1, 1, 1): build_model gives LlamaModel's names, weights, logits and gradients; with activation
    checkpointing every probe still reports once per forward and its dL/dY hook fires once."""
    cfg = tiny_config(num_layers=3, norm_position="pre", prefix_alpha=0.3)
    plain = LlamaModel(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    labels, mask = tokens.roll(-1, 1), torch.ones(2, cfg.seq_length)
    lm_loss(plain(tokens), labels, mask).backward()
    for ckpt in (False, True):
        model, loss_fn = build_model(cfg, ParallelState(), checkpoint_activations=ckpt)
        assert {k: v.shape for k, v in model.state_dict().items()} == {
            k: v.shape for k, v in plain.state_dict().items()}
        assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())
        counter = ProbeCounter()
        set_listener(model, counter)
        loss_fn(model(tokens), labels, mask).backward()
        assert sum(counter.forward.values()) == 2 + 2 * cfg.num_layers, counter.forward
        assert set(counter.forward.values()) == set(counter.backward.values()) == {1}
        grads = dict(model.named_parameters())
        assert all(torch.equal(grads[k].grad, p.grad) for k, p in plain.named_parameters())
