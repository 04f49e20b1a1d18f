"""megapost.parallel.dist_optimizer on gloo ranks: bucket layout, losses against DP 1 and against torch's
AdamW, the skip path, a checkpoint resharded to another data-parallel size, and the overlap proof (the
recorded issue order of collectives against the forward and backward they overlap)."""

from __future__ import annotations

import pytest
import torch
from dist_opt_train import count_step, reshard, trace_step, train, train_plain, train_tp
from dist_utils import run_ranks

from megapost.parallel.dist_optimizer import BucketLayout, bucket_layouts


def test_bucket_layouts_close_at_size_and_pad_to_the_group() -> None:
    # sizes 3+5 = 8 >= 6 closes bucket 0 (8, a multiple of 4); 2+7 = 9 pads to 12
    assert bucket_layouts([3, 5, 2, 7], 6, 4) == [BucketLayout(0, 1, (0, 3), 8),
                                                  BucketLayout(2, 3, (0, 2), 12)]
    assert bucket_layouts([10], 100, 3) == [BucketLayout(0, 0, (0,), 12)]
    assert BucketLayout(0, 0, (0,), 12).shard(2, 3) == (8, 12)


@pytest.mark.slow
def test_fp32_dp2_equals_dp1_bit_for_bit_and_torch_adamw() -> None:
    """DP 2 x 1 micro-batch sums two gradients and halves them; DP 1 x 2 adds two halved gradients: the
    same fp32 numbers (halving is exact), so losses and weights agree bit for bit; so does torch's own
    AdamW on the unbucketed model (elementwise, foreach off)."""
    dp2 = run_ranks(train, 2, 4, 1)
    dp1 = run_ranks(train, 1, 4, 2)[0]
    plain = run_ranks(train_plain, 1, 4, 2)[0]
    assert dp2[0]["losses"] == dp2[1]["losses"] == dp1["losses"] == plain["losses"]
    for k, v in dp1["params"].items():
        assert torch.equal(dp2[0]["params"][k], v) and torch.equal(dp2[1]["params"][k], v), k
        assert torch.equal(plain["params"][k], v), k


@pytest.mark.slow
def test_more_micro_batches_and_bf16_within_tolerance() -> None:
    """DP 2 x 2 against DP 1 x 4 adds the four gradients in another order: fp32 losses within 1e-6
    relative; bf16 weights (fp32 masters, clip 1.0, gradients reduced in bf16) within 2e-2 (bf16 rounding
    of the weights differs once a master weight differs in its last bit)."""
    for bf16, tol in ((False, 1e-6), (True, 2e-2)):
        dtype = torch.bfloat16 if bf16 else torch.float32
        dp2 = run_ranks(train, 2, 4, 2, bf16, 1.0, 6000, 0, dtype)[0]["losses"]
        dp1 = run_ranks(train, 1, 4, 4, bf16, 1.0, 6000, 0, dtype)[0]["losses"]
        assert max(abs(a - b) / abs(b) for a, b in zip(dp2, dp1, strict=True)) < tol, (bf16, dp2, dp1)


@pytest.mark.slow
def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere() -> None:
    """Rank 0's final-norm gradient is infinite at step 2: after the reduce-scatter only the rank owning
    that shard sees it, and the all-reduced norm makes both skip."""
    ranks = run_ranks(train, 2, 3, 1, False, 1.0, 6000, 2)
    clean = run_ranks(train, 2, 3, 1, False, 1.0, 6000, 0)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [False, True, False]
    assert clean[0]["skipped"] == [False, False, False]
    # the skipped step changed nothing but Adam's schedule did not advance either: step 3 of the skipped
    # run starts from step 1's weights, so its loss differs from the clean run's step 3 loss
    assert ranks[0]["losses"][:2] == clean[0]["losses"][:2] and ranks[0]["losses"][2] != clean[0]["losses"][2]
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.slow
def test_checkpoint_resharded_from_dp2_to_dp1_continues_bit_for_bit() -> None:
    ranks = run_ranks(reshard, 2, 2)
    assert ranks[0]["dp1"] == ranks[0]["dp2"] == ranks[1]["dp2"]


@pytest.mark.slow
def test_gathers_and_reduce_scatters_overlap_compute() -> None:
    """Step 2 at DP 2 (bf16, two micro-batches): bucket i+1's weight all-gather is issued before the
    forward of bucket i ends, and a bucket's reduce-scatter is issued before the backward ends (before
    the first bucket's gradients are computed)."""
    rank0 = run_ranks(trace_step, 2)[0]
    ev, buckets = rank0["events"], rank0["buckets"]
    assert len(buckets) >= 3, buckets
    forward = ev[:next(j for j, e in enumerate(ev) if e.startswith("grad "))]  # micro-batch 1's forward
    for i in range(len(buckets) - 1):
        end_i = max(j for j, e in enumerate(forward) if e in {f"forward end {n}" for n in buckets[i]})
        assert forward.index(f"all_gather {i + 1}") < end_i, (i, forward)
    first_grads = max(j for j, e in enumerate(ev) if e in {f"grad {n}" for n in buckets[0]})
    assert ev.index(f"reduce_scatter {len(buckets) - 1}") < first_grads, ev


@pytest.mark.slow
def test_bytes_per_step_are_one_reduce_scatter_and_one_gather() -> None:
    """Counted on gloo at DP 2 (tests/comm_count): per step each rank sends half of the fp32 gradient
    (reduce-scatter, 4 B) and half of the bf16 weights (all-gather, 2 B): 0.5 * 6 * P bytes, at 1 and 4
    micro-batches alike (plus two 8-byte all-reduces: the loss and the norm), one of each per bucket;
    the planner's formula says the same."""
    from comm_count import install

    from megapost.parallel.reduce_bytes import dist_optimizer_bytes

    for r in run_ranks(count_step, 2, [1, 4], True, setup=install)[0]:
        expected = 0.5 * (4 + 2) * r["params"]
        assert abs(sum(r["wire"].values()) / expected - 1) < 1e-3, r
        assert r["calls"]["reduce_scatter_tensor"] == r["calls"]["all_gather_into_tensor"] == r["buckets"]
        assert dist_optimizer_bytes(r["params"], 2, bf16=True).total == expected


@pytest.mark.slow
def test_with_tensor_and_sequence_parallelism() -> None:
    """TP 2 + SP x DP 2 (megapost's parallel model, 4 gloo ranks) against DP 1 x 2 micro-batches of the
    plain model, both clipped at 0.05 (the global norm: the TP shards summed, replicated parameters
    once): losses within 1e-5 relative (TP sums the vocabulary and row-parallel products in another
    order); the data-parallel group moves 0.5 * 8 B per local parameter per step (fp32)."""
    from comm_count import install

    ranks = run_ranks(train_tp, 4, 4, 1, 2, True, False, 0.05, setup=install)
    dp1 = run_ranks(train, 1, 4, 2, False, 0.05)[0]["losses"]
    for r in ranks:
        assert max(abs(a - b) / b for a, b in zip(r["losses"], dp1, strict=True)) < 1e-5, (r["losses"], dp1)
        assert abs(r["by_axis"]["dp"] / (0.5 * 8 * r["params"]) - 1) < 0.01, r


@pytest.mark.slow
def test_sequence_parallel_gains_summed_once_per_step() -> None:
    """The same TP 2 + SP x DP 2 run at 2 micro-batches, the gains' partial sums deferred to the
    optimizer: one all-reduce per step ("partial_sums") instead of one per gain per micro-batch, and the
    same losses as the per-micro-batch reduction within 1e-6 relative."""
    hooks = run_ranks(train_tp, 4, 3, 2, 2)[0]
    once = run_ranks(train_tp, 4, 3, 2, 2, False, True)[0]
    assert once["deferred"] > 0 and once["events"].count("partial_sums") == 1
    assert hooks["tp_all_reduces"] - once["tp_all_reduces"] == 2 * once["deferred"], (hooks, once)
    assert max(abs(a - b) / b for a, b in zip(once["losses"], hooks["losses"], strict=True)) < 1e-6
