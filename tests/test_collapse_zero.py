"""Per-layer gradient norms through a real DeepSpeed engine (2 data-parallel gloo ranks): ZeRO 0/1/2,
fp32 and bf16 (DeepSpeed's BF16 optimizer with fp32 accumulation, as megapost configures it). The
plugin reads only the gradient fragment each rank owns and pools the squared norms in its one
reduction; the reference assembles every full gradient with ``safe_get_full_grad`` (one all-reduce per
parameter) at the same point, the trainer's seam just before the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
from collapse_helpers import make_plugin, random_batches, small_config
from dist_utils import run_ranks

from megapost.ds_adapter.deepspeed_engine import DeepSpeedEngine
from megapost.model import lm_loss
from megapost.optim import hooks as optim_hooks
from megapost.train.plugin_binding import bind_plugins

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

CONFIGS = [(0, False), (1, False), (2, False), (1, True), (2, True)]  # (ZeRO stage, bf16)


def full_grad_norms(model: torch.nn.Module) -> dict[int, dict[str, float]]:
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for block in model.layers:
        sq = {"attn": 0.0, "ffn": 0.0, "norms": 0.0}
        for name, p in block.named_parameters():
            key = {"attention": "attn", "mlp": "ffn"}.get(name.split(".")[0], "norms")
            sq[key] += float(safe_get_full_grad(p).double().square().sum())
        out[block.layer_number] = {"attn": math.sqrt(sq["attn"]), "ffn": math.sqrt(sq["ffn"]),
                                   "norms": math.sqrt(sq["norms"]), "layer": math.sqrt(sum(sq.values()))}
    return out


def train_configs() -> list[tuple[dict, dict]]:
    """On every rank, for each config: one step through the engine; (plugin records, reference)."""
    import deepspeed

    from megapost.parallel import build_model, initialize_parallel

    pstate = initialize_parallel(1, 1, False)
    cfg = small_config("post")
    results = []
    for stage, bf16 in CONFIGS:
        model, _ = build_model(cfg, pstate)
        plugin = make_plugin(cfg, pstate=pstate)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        if bf16:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        reference = {}

        # the plugin reads gradients through its PluginContext, from the Engine protocol
        bind_plugins([plugin], DeepSpeedEngine(engine, lm_loss, pipeline=False, tp_rank=pstate.tp_rank,
                                               dp_rank=pstate.dp_rank))

        def before_step(plugin=plugin, reference=reference, model=model) -> None:
            plugin.before_optimizer_step(1)
            reference.update(full_grad_norms(model))

        optim_hooks.install(engine, before_step)
        plugin.on_step_begin(1, engine.module)
        batches = random_batches(cfg, 4, batch=2, seed=1)[pstate.dp_rank::2]
        for batch in batches:
            logits = engine(batch["tokens"])
            engine.backward(lm_loss(logits, batch["labels"], batch["loss_mask"]))
            engine.step()
        plugin.on_step_end(1, 0.0)
        results.append((plugin.last, reference, type(engine.optimizer).__name__))
    return results


def test_grad_norms_under_zero_partitioning():
    ranks = run_ranks(train_configs, 2)
    for (stage, bf16), (last, reference, optimizer) in zip(CONFIGS, ranks[-1], strict=True):
        what = f"ZeRO-{stage} bf16={bf16} ({optimizer})"
        for rec in last["layers"]:
            ref = reference[rec["layer"]]
            assert rec["grad_norm"] == pytest.approx(ref[rec["sublayer"]], rel=1e-5), what
            assert rec["grad_norm_layer"] == pytest.approx(ref["layer"], rel=1e-5), what
            assert rec["grad_norm_norms"] == pytest.approx(ref["norms"], rel=1e-5), what
            assert rec["alpha"] is not None and rec["alpha"] > 0
