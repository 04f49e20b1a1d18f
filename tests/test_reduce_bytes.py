"""Gradients reduced once per optimizer step: the bytes the real trainer's collectives move per step at
DP2 (gloo, counted by tests/comm_count.py) for 1, 4 and 8 micro-batches, beside the planner's
data-parallel term for the same layout, and the start-up line that names them."""

from __future__ import annotations

import pytest
import torch

from megapost.config.resolved import resolve
from megapost.optim.ds_config import build_ds_config
from megapost.optim.grad_reduce import configure_grad_reduction
from megapost.plan.memory import Layout
from megapost.plan.search import comm_parts


def _planned(micro_batches: int, zero_stage: int) -> float:
    from comm_count import MODEL
    from dist_utils import tiny_config

    return comm_parts(tiny_config(**MODEL), Layout(1, 1, 2, zero_stage, 1, micro_batches), 2 * micro_batches,
                      bf16=True)["dp"]


@pytest.mark.slow  # one 2-rank launch, 5 short runs: 70 s on 2 cores (5 min on a loaded box)
def test_bytes_per_step_match_the_planner_and_do_not_grow_with_micro_batches() -> None:
    from comm_count import run_counts

    flags = ["--bf16", "--overlap-grad-reduce"]
    runs = [(1, flags), (4, flags), (8, flags), (4, [*flags, "--zero-stage", "2"]),
            (8, [*flags, "--zero-stage", "2"])]
    rank0 = run_counts(runs)[0]
    for r in rank0:
        counted, m, params = sum(r["wire"].values()), r["micro_batches"], r["params"]
        planned = _planned(m, r["zero_stage"])
        print(f"mb {m} ZeRO-{r['zero_stage']} {r['optimizer']}: counted {counted / 2**20:.2f} MiB, "
              f"planned {planned / 2**20:.2f} MiB, payload {sum(r['payload'].values()) / 2**20:.2f} MiB")
        assert counted == pytest.approx(planned, rel=0.05), r
        # independently of the planner: fp32 gradients (4 bytes per parameter) all-reduced k times
        reduced = r["payload"].get("all_reduce", 0) / (4 * params)
        assert reduced == pytest.approx(m if r["zero_stage"] == 2 else 1, rel=0.01), r
    default = {r["micro_batches"]: r for r in rank0[:3]}
    assert default[1]["zero_stage"] == 2  # one micro-batch: ZeRO-2 overlaps at ZeRO-1's bytes
    assert default[4]["optimizer"] == default[8]["optimizer"] == "BF16_Optimizer"
    for m in (4, 8):  # megapost's overlapped reduction: one all-reduce per bucket, the same bytes
        assert default[m]["overlap_buckets"] >= 8, default[m]
        assert default[m]["calls"]["all_reduce"] >= default[m]["overlap_buckets"], default[m]
    one = sum(default[1]["wire"].values())
    assert sum(default[8]["wire"].values()) == pytest.approx(one, rel=0.01)  # reduced once per step
    assert sum(rank0[4]["wire"].values()) > 5 * one  # explicit ZeRO-2 still reduces every micro-batch
    for once, every in ((rank0[1], rank0[3]), (rank0[2], rank0[4])):  # the same training either way
        assert once["loss"] == pytest.approx(every["loss"], rel=1e-3)


@pytest.mark.parametrize("global_batch, stage, overlap", [(2, 2, True), (8, 1, True), (16, 1, True)])
def test_bf16_overlap_resolves_to_the_stage_with_fewer_bytes(tiny_data, global_batch, stage, overlap) -> None:
    """DP2 micro-batch 1: one micro-batch per step runs ZeRO-2 (overlapped); more run ZeRO-1, reduced
    once, overlapped with the last micro-batch's backward, and the start-up lines say so with the
    bytes: for a 1024 x 1024 (+ bias) layer, P = 1,049,600,
    an fp32 all-reduce sends 2 (n-1)/n 4P = 4P and the bf16 all-gather (n-1)/n 2P = P at n = 2."""
    from launch_utils import tiny_model_flags

    from megapost.train.prepare import prepare

    prep = prepare([*tiny_model_flags(tiny_data, **{"--train-iters": 6}), "--bf16", "--overlap-grad-reduce",
                    "--micro-batch-size", "1", "--global-batch-size", str(global_batch)], world_size=2)
    engine = resolve(prep.args, prep.model, "cpu").engine
    assert (engine.zero_stage, engine.overlap_grad_reduce) == (stage, overlap)
    ds = build_ds_config(engine, {})
    notes = configure_grad_reduction(ds, engine, torch.nn.Linear(1024, 1024), dp_size=2)
    params, m = 1024 * 1024 + 1024, global_batch // 2
    grads = (4 * params * (m if stage == 2 else 1)) / 2**20
    assert notes[-1].startswith(f"gradients reduced once per step (ZeRO-{stage}, {m} micro-batch")
    assert f"{grads + params / 2**20:,.1f} MiB per rank per step" in notes[-1]
    if stage == 1:
        assert any(f"{m} micro-batches per step: ZeRO stage 1" in n and "asynchronously" in n
                   for n in engine.reduce_notes)
        assert any(n.startswith("gradient reduction overlapped with the last micro-batch's backward")
                   for n in notes)
