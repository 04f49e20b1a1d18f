"""The native engine (``--use-distributed-optimizer``: megapost's distributed optimizer, no DeepSpeed) in
the real trainer, built as users build it (``build(prepare(argv))``, the layout harness): losses against
DP 1 and against DeepSpeed's engine at DP 1, tensor + sequence parallelism, the skip contract of
tests/test_skip_step.py, the overlap proof and the refusals."""

from __future__ import annotations

import pytest
import torch
from dist_utils import RunSpec, max_rel_diff, run_layouts, run_ranks
from native_train import NATIVE, check_overlap, params_equal, rollback_losses, small_buckets, trace_trainer
from skip_inject import Case, run_cases
from test_skip_step import check_skipped

NAN = float("nan")


def _spec(global_batch: int, *flags: str, **kw: object) -> RunSpec:
    return RunSpec(steps=6, global_batch=global_batch, micro_batch=2, flags=flags, **kw)  # type: ignore[arg-type]


@pytest.mark.integration
def test_dp2_and_dp4_equal_dp1_and_deepspeed() -> None:
    """DP n x 1 micro-batch sums n gradients (gloo's reduce-scatter) and divides by n; DP 1 x n micro-batches
    adds the n gradients each scaled by 1/n (the loss over n): the same numbers where scaling by a power
    of two is exact and gloo adds in rank order — fp32 DP 2 losses and weights, fp32 DP 4 and bf16
    DP 2 losses bit for bit (measured; a reduction in another order would need ~1e-6). The native engine
    at DP 1 against DeepSpeed's ZeRO-0 at DP 1 (another implementation of the step: the same AdamW
    arithmetic): losses bit for bit."""
    one = run_layouts([_spec(4, *NATIVE), _spec(8, *NATIVE), _spec(4, "--zero-stage", "0"),
                       _spec(4, *NATIVE, "--bf16")], dp=1)
    dp1_2, dp1_4, ds1_2, bf1 = (r[0] for r in one)
    two = run_layouts([_spec(4, *NATIVE), _spec(4, *NATIVE, "--bf16")], dp=2)
    dp2, bf2 = two[0][0], two[1][0]
    dp4 = run_layouts([_spec(8, *NATIVE)], dp=4)[0][0]
    print("DP1 native", dp1_2["losses"], "\nDP2 native", dp2["losses"], "\nDP1 DeepSpeed", ds1_2["losses"])
    print("DP4 vs DP1 x 4", max_rel_diff(dp4["losses"], dp1_4["losses"]),
          "bf16 DP2 vs DP1", max_rel_diff(bf2["losses"], bf1["losses"]))
    assert dp2["losses"] == dp1_2["losses"] and params_equal(dp2["params"], dp1_2["params"])
    assert max_rel_diff(dp2["grad_norms"], dp1_2["grad_norms"]) < 1e-6  # fp64 sums of shards, another order
    assert dp1_2["losses"] == ds1_2["losses"]
    assert dp4["losses"] == dp1_4["losses"]
    assert bf2["losses"] == bf1["losses"]
    assert bf2["losses"] != dp2["losses"]  # bf16 ran in bf16


@pytest.mark.integration
def test_tp2_sp_dp2_equals_dp1() -> None:
    """TP 2 + SP x DP 2 on the native engine (the sequence-parallel gains' partial sums reduced once per
    step, the clip norm over DP and TP with replicated parameters counted once) against DP 1 of the same
    model: losses within 1e-5 relative (TP sums in another order), clipped at 0.05 so the clip acts."""
    spec = _spec(8, *NATIVE, tp=2, sp=True, clip=0.05)
    tp = run_layouts([spec], dp=2)[0][0]
    ref = run_layouts([_spec(8, *NATIVE, clip=0.05)], dp=1)[0][0]
    print("TP2+SP x DP2", tp["losses"], "\nDP1", ref["losses"], max_rel_diff(tp["losses"], ref["losses"]))
    assert max_rel_diff(tp["losses"], ref["losses"]) < 1e-5
    assert max_rel_diff(tp["grad_norms"], ref["grad_norms"]) < 1e-4
    assert min(tp["grad_norms"]) > 0.05  # the clip acted on every step


@pytest.mark.integration
def test_skip_contract_dp2_fp32_and_bf16() -> None:
    """tests/test_skip_step.py's contract on the native engine at DP 2: the masters, both moments, the step
    count, the module and the lr schedule unchanged across the skipped step, the next step trains, the
    skip counted once; the bad value only in global rank 0's gradient."""
    cases = [Case("DP2 native fp32 inf", NATIVE), Case("DP2 native bf16 NaN", (*NATIVE, "--bf16"), value=NAN)]
    by_rank = run_ranks(run_cases, 2, cases)
    for case, ranks in zip(cases, zip(*by_rank, strict=True), strict=True):
        print(case.name, check_skipped(case, list(ranks)))


@pytest.mark.integration
def test_gathers_and_reduce_scatters_overlap_compute_in_the_trainer() -> None:
    """Step 2 of the trainer at DP 2 (bf16, two micro-batches, buckets of 20 k elements): bucket i+1's
    weight all-gather is issued before the forward of bucket i ends, and the last bucket's reduce-scatter
    before the first bucket's gradients are in (before the backward ends)."""
    rank0 = run_ranks(trace_trainer, 2, ("--bf16",), setup=small_buckets)[0]
    check_overlap(rank0["events"], rank0["buckets"])


@pytest.mark.integration
def test_snapshot_and_restore_continue_exactly() -> None:
    """The in-memory rollback the plugins use (``Trainer.snapshot`` / ``restore`` over the engine's
    ``state_dict``): after step 1, steps 2-3, back to the snapshot, steps 2-3 again — the same losses and
    norm bit for bit at DP 2 bf16 (module, fp32 shards, Adam moments and schedule restored)."""
    first, second = run_ranks(rollback_losses, 2, ("--bf16",))[0]["runs"]
    assert first == second, (first, second)


@pytest.mark.integration
def test_bytes_per_step_in_the_trainer_match_the_planner() -> None:
    """DP 2 bf16 in the trainer (tests/comm_count, buckets of 500 k elements): the data-parallel group
    sends (n-1)/n * (4 + 2) B per parameter per step — one reduce-scatter and one all-gather per bucket —
    at 1 and 4 micro-batches alike, the planner's figure (megapost.plan.search.comm_parts) within 0.1 %."""
    from comm_count import MODEL, count_runs
    from dist_utils import tiny_config
    from native_train import counted_native_setup

    from megapost.plan.memory import Layout
    from megapost.plan.search import comm_parts

    runs = [(m, [*NATIVE, "--bf16"]) for m in (1, 4)]
    for (m, _), r in zip(runs, run_ranks(count_runs, 2, runs, setup=counted_native_setup)[0], strict=True):
        plan = comm_parts(tiny_config(**MODEL), Layout(1, 1, 2, 1, 1, m, distributed_optimizer=True), 2 * m,
                          bf16=True)["dp"]
        print(m, r["by_axis"], plan, r["calls"])
        assert abs(r["by_axis"]["dp"] / plan - 1) < 1e-3 and plan == 0.5 * 6 * r["params"], (r, plan)
        calls = r["calls"]
        assert calls["reduce_scatter_tensor"] == calls["all_gather_into_tensor"] == r["overlap_buckets"]
        assert r["overlap_buckets"] == 7 and r["zero_stage"] == "native"


@pytest.mark.integration
def test_sequence_parallel_gains_reduced_once_per_step() -> None:
    """TP 2 + SP x DP 2 bf16 in the trainer: the native engine sums the sequence-parallel norm gains'
    partial gradients in one all-reduce per step, so going from 4 to 8 micro-batches adds only the
    vocab-parallel loss's 2 all-reduces per micro-batch (DeepSpeed's path adds one per gain as well: 10
    per micro-batch on this model, docs/multi-gpu.md); the data-parallel bytes do not change."""
    from comm_count import count_runs
    from native_train import counted_native_setup

    flags = [*NATIVE, "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    four, eight = run_ranks(count_runs, 4, [(4, flags), (8, flags)], setup=counted_native_setup)[0]
    print(four["calls"], eight["calls"])
    grown = eight["calls"]["all_reduce"] - four["calls"]["all_reduce"]
    assert grown == 2 * 4, (four["calls"], eight["calls"])
    assert eight["by_axis"]["dp"] == four["by_axis"]["dp"]


def test_refusals_name_the_flag_in_one_line() -> None:
    """A DeepSpeed JSON, and interleaved micro-batches that do not make equal rounds, are refused, each
    in one line; PP > 1 runs."""
    from types import SimpleNamespace as NS

    from megapost.native.build import refusals

    def config(pp: int = 1, virtual: int | None = None, m: int = 4) -> NS:
        return NS(parallel=NS(pipeline_model_parallel_size=pp, virtual_pipeline_layers=virtual),
                  engine=NS(batch=NS(grad_accum_steps=m)))

    assert refusals(config(), {}) == [] and refusals(config(pp=2), {}) == []
    assert refusals(config(pp=2, virtual=1, m=6), {}) == []  # 3 rounds of 2
    (line,) = refusals(config(pp=2, virtual=1, m=5), {})  # 2 rounds of 5 micro-batches: not equal
    assert line.startswith("--num-layers-per-virtual-pipeline-stage with 5 micro-batches per step at "
                           "--pipeline-model-parallel-size 2: ") and "\n" not in line
    assert "--deepspeed-config" in refusals(config(), {"zero_optimization": {}})[0]


@pytest.mark.integration
@pytest.mark.slow  # five 2-rank or 1-rank launches: ~3 min on 2 cores
def test_save_resume_bit_exact_and_resharded(tiny_data, tmp_path) -> None:
    """DP 2 fp32 on the native engine, saved at iteration 2 (the layout-free format, through the Engine
    protocol): resumed at DP 2 and at DP 1 (another shard layout; 2 micro-batches per step, bit-exact
    as DP 2 x 1 by test_dp2_and_dp4_equal_dp1_and_deepspeed) it trains iterations 3-4 with the losses
    of the uninterrupted run, bit for bit."""
    from ckpt_faults import train
    from launch_utils import read_scalars, tiny_model_flags

    def argv(iters: int, tb: str, **extra: object) -> list[str]:
        flags = {"--train-iters": iters, "--lr-decay-iters": 10, "--tensorboard-dir": tmp_path / tb, **extra}
        return [*map(str, tiny_model_flags(tiny_data, **flags)), *NATIVE]

    run_ranks(train, 2, argv(4, "ref"))
    run_ranks(train, 2, argv(2, "a", **{"--save": tmp_path / "ckpt"}))
    run_ranks(train, 2, argv(4, "b", **{"--load": tmp_path / "ckpt"}))
    run_ranks(train, 1, argv(4, "c", **{"--load": tmp_path / "ckpt"}))
    ref, dp2, dp1 = (read_scalars(tmp_path / d, "train/lm_loss") for d in ("ref", "b", "c"))
    print("uninterrupted", ref, "\nresumed DP 2", dp2, "\nresumed DP 1", dp1)
    assert sorted(dp2) == sorted(dp1) == [3, 4], (dp2, dp1)
    assert all(dp2[s] == ref[s] and dp1[s] == ref[s] for s in (3, 4)), (ref, dp2, dp1)


def test_found_inf_skips_fused_adamw_on_the_device() -> None:
    """The skip the native engine relies on: fused AdamW with ``found_inf`` 1 leaves the parameter, both
    moments and the step count as they were; with 0 it steps (torch's own kernel, checked here)."""
    from megapost.parallel.dist_optimizer import takes_found_inf

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(4)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(p, before[0]) and all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    opt.found_inf = torch.zeros(())
    opt.step()
    assert not torch.equal(p, before[0]) and float(opt.state[p]["step"]) == 2.0
    assert takes_found_inf(opt) and not takes_found_inf(torch.optim.AdamW([p], lr=0.1))
