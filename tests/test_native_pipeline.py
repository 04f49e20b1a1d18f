"""megapost.native.pipeline: megapost's model cut into pipeline chunks and run by torch.distributed.pipelining
on 2 gloo ranks, the interleaved schedule (2 virtual chunks per rank) against plain 1F1B and against the
unpipelined model in one process."""

from __future__ import annotations

import pytest
from dist_utils import max_rel_diff, run_ranks
from pipeline_train import pipeline_losses, reference_losses


def test_chunks_follow_megatrons_order() -> None:
    from megapost.native.pipeline import chunk_indices

    assert chunk_indices(8, 2, 2, 0) == [(0, 0, 2), (2, 4, 6)]
    assert chunk_indices(8, 2, 2, 1) == [(1, 2, 4), (3, 6, 8)]
    assert chunk_indices(4, 2, 1, 1) == [(1, 2, 4)]
    with pytest.raises(ValueError, match="equal chunks"):
        chunk_indices(6, 2, 2, 0)


@pytest.mark.integration
def test_interleaved_equals_1f1b_and_the_unpipelined_model() -> None:
    """PP 2, 4 micro-batches, AdamW, 3 steps: the interleaved schedule's losses equal 1F1B's bit for bit
    (each chunk sees the same micro-batches in the same order; only the interleaving differs) and the
    one-process model's bit for bit (the pipeline scales the accumulated gradients by 1/4, the one-process
    run each micro-batch's: exact either way);
    rank 0 ran its two chunks interleaved (stage 2's first forward before stage 0's last)."""
    one = run_ranks(pipeline_losses, 2, 1)
    inter = run_ranks(pipeline_losses, 2, 2)
    ref = reference_losses()
    print("1F1B", one[1]["losses"], "\ninterleaved", inter[1]["losses"], "\none process", ref)
    assert inter[1]["losses"] == one[1]["losses"]
    assert one[1]["losses"] == ref, max_rel_diff(one[1]["losses"], ref)
    order = inter[0]["forward_order"]
    assert sorted(set(order)) == [0, 2] and order.index(2) < len(order) - 1 - order[::-1].index(0), order


# ---- in the trainer (``--use-distributed-optimizer`` with --pipeline-model-parallel-size 2) ----------

NATIVE = ("--use-distributed-optimizer",)
VIRTUAL = ("--num-layers-per-virtual-pipeline-stage", "1")  # 4 layers on PP 2: 2 chunks per rank


def _spec(pp: int, *flags: str, native: bool = True, global_batch: int = 8, **kw: object) -> object:
    from dist_utils import RunSpec

    return RunSpec(steps=4, global_batch=global_batch, micro_batch=2, pp=pp,  # type: ignore[arg-type]
                   flags=(*(NATIVE if native else ()), *flags), **kw)


@pytest.mark.integration
def test_pp2_equals_dp1_and_interleaved_equals_1f1b_in_the_trainer() -> None:
    """PP 2 on the native engine, 4 micro-batches of the tiny model (fp32, clip 1), through
    ``build(prepare(argv))``: 1F1B and the interleaved schedule (2 virtual stages per rank) against the
    native engine at DP 1 and DeepSpeed's ZeRO-0 at DP 1 — losses and final weights **bit for bit**
    (and at one micro-batch per step, in bf16, and interleaved with --checkpoint-activations, against the
    native DP 1 of the same, losses):
    every chunk adds the same micro-batches' gradients in the same order (each scaled by 1/4, exact), the
    norm is a sum over PP ranks of fp64 parts (another order, asserted on the losses only through the clip
    coefficient, which equals DP 1's here)."""
    from dist_utils import run_layouts
    from native_train import params_equal

    pp = run_layouts([_spec(2), _spec(2, *VIRTUAL), _spec(2, global_batch=2), _spec(2, "--bf16"),
                      _spec(2, *VIRTUAL, checkpoint_activations=True)], dp=1)
    one, inter = pp[0][-1], pp[1][-1]  # the last pipeline rank holds the loss; rank 0 the full weights
    native, ds, single, bf16 = (r[0] for r in run_layouts(
        [_spec(1), _spec(1, "--zero-stage", "0", native=False), _spec(1, global_batch=2), _spec(1, "--bf16")],
        dp=1))
    print("PP2 1F1B", one["losses"], "\nPP2 interleaved", inter["losses"], "\nDP1", native["losses"],
          "\nDeepSpeed DP1", ds["losses"])
    assert [r["local_layers"] for r in pp[0]] == [2, 2] and [r["local_layers"] for r in pp[1]] == [2, 2]
    assert one["losses"] == native["losses"] == ds["losses"]
    assert inter["losses"] == one["losses"]
    print("PP2 one micro-batch", pp[2][-1]["losses"], single["losses"], "\nbf16", pp[3][-1]["losses"],
          bf16["losses"])
    assert pp[2][-1]["losses"] == single["losses"]  # fewer micro-batches than stages: GPipe's order
    assert pp[3][-1]["losses"] == bf16["losses"] != native["losses"]
    assert pp[4][-1]["losses"] == native["losses"]  # each chunk's blocks recomputed in backward: exact
    assert params_equal(pp[0][0]["params"], native["params"]) and params_equal(pp[1][0]["params"],
                                                                                native["params"])


@pytest.mark.integration
def test_pp2_dp2_equals_dp2_and_tp2_sp_pp2_within_tolerance() -> None:
    """PP 2 x DP 2 against PP 1 x DP 2 (the same data-parallel reduction, gloo's, in rank order): losses
    bit for bit. TP 2 + SP x PP 2 against DP 1: losses within 1e-5 relative (the tensor-parallel sums
    add partial products in another order: measured ~2e-7)."""
    from dist_utils import max_rel_diff, run_layouts

    pp_dp = run_layouts([_spec(2)], dp=2)[0][-1]
    tp_pp = run_layouts([_spec(2, tp=2, sp=True)], dp=1)[0][-1]
    dp2 = run_layouts([_spec(1)], dp=2)[0][0]
    dp1 = run_layouts([_spec(1)], dp=1)[0][0]
    print("PP2 x DP2", pp_dp["losses"], "\nDP2", dp2["losses"], "\nTP2+SP x PP2", tp_pp["losses"])
    assert pp_dp["losses"] == dp2["losses"]
    assert 0 < max_rel_diff(tp_pp["losses"], dp1["losses"]) < 1e-5


@pytest.mark.integration
@pytest.mark.slow  # five 1- to 4-rank launches of megapost's pretrain: 22 s on 2 idle cores, ~2 min loaded
def test_pp2_save_resumes_at_pp2_and_pp1_bit_for_bit(tiny_data, tmp_path) -> None:
    """PP 2 on the native engine through ``megapost.pretrain.run`` (2 layers, one per stage, 2
    micro-batches), evaluated every 2 iterations (the schedule's forward only), saved at iteration 2 in
    the layout-free format: resumed at PP 2, at PP 1 and at PP 2 x DP 2 (the same tensors resharded by
    the unchanged checkpoint package; DP 2 x 1 micro-batch = DP 1 x 2 bit for bit, halving is exact) it
    trains iterations 3-4 with the uninterrupted run's losses and validation loss bit for bit (at DP 2 the
    mean of the two ranks' micro-batch losses: the same two numbers halved)."""
    from ckpt_faults import train
    from dist_utils import run_ranks
    from launch_utils import read_scalars, tiny_model_flags

    def argv(iters: int, tb: str, pp: int, **extra: object) -> list[str]:
        flags = {"--train-iters": iters, "--lr-decay-iters": 10, "--tensorboard-dir": tmp_path / tb,
                 "--pipeline-model-parallel-size": pp, "--eval-interval": 2, "--eval-iters": 1, **extra}
        return [*map(str, tiny_model_flags(tiny_data, **flags)), *NATIVE]

    run_ranks(train, 2, argv(4, "ref", 2))
    run_ranks(train, 2, argv(2, "a", 2, **{"--save": tmp_path / "ckpt"}))
    run_ranks(train, 2, argv(4, "b", 2, **{"--load": tmp_path / "ckpt"}))
    run_ranks(train, 1, argv(4, "c", 1, **{"--load": tmp_path / "ckpt"}))
    run_ranks(train, 4, argv(4, "d", 2, **{"--load": tmp_path / "ckpt"}))
    ref, pp2, pp1, dp2 = (read_scalars(tmp_path / d, "train/lm_loss") for d in ("ref", "b", "c", "d"))
    valid = [read_scalars(tmp_path / d, "valid/lm_loss") for d in ("ref", "b", "c", "d")]
    print("uninterrupted", ref, valid[0], "\nresumed PP 2", pp2, valid[1], "\nresumed PP 1", pp1, valid[2],
          "\nresumed PP 2 x DP 2", dp2, valid[3])
    assert sorted(pp2) == sorted(pp1) == sorted(dp2) == [3, 4], (pp2, pp1, dp2)
    assert all(pp2[s] == ref[s] == pp1[s] == dp2[s] for s in (3, 4)), (ref, pp2, pp1, dp2)
    assert 4 in valid[0] and valid[1][4] == valid[0][4] == valid[2][4] == valid[3][4], valid


def _trace_pipeline(virtual: bool) -> dict:
    """Rank function: step 2's recorded issue order on the native pipeline, PP 2, 4 micro-batches."""
    from native_train import trace_trainer

    pp = ("--pipeline-model-parallel-size", "2")
    return trace_trainer((*pp, *VIRTUAL) if virtual else pp, micro_batches=2)


@pytest.mark.integration
def test_reduce_scatters_start_at_each_chunks_last_backward() -> None:
    """Overlap under PP (buckets of 20 k elements, rank 0): 1F1B — bucket i + 1's gather issued before the
    forward of bucket i ends, the last bucket's reduce-scatter before the first bucket's gradients are in;
    interleaved (rank 0 holds chunk 0 = embedding + layer 0 and chunk 2 = layer 2) — a bucket of chunk 2
    only is reduce-scattered before chunk 0's last gradients are in, i.e. inside the schedule, not after."""
    from dist_utils import run_ranks
    from native_train import check_overlap, small_buckets

    one = run_ranks(_trace_pipeline, 2, False, setup=small_buckets)[0]
    check_overlap(one["events"], one["buckets"])
    inter = run_ranks(_trace_pipeline, 2, True, setup=small_buckets)[0]
    events, buckets = inter["events"], inter["buckets"]
    late = [i for i, names in enumerate(buckets) if all(n.startswith("layers.2.") for n in names)]
    early = {f"grad {n}" for names in buckets for n in names if not n.startswith("layers.2.")}
    assert late and early, buckets
    last_early = max(j for j, e in enumerate(events) if e in early)
    assert events.index(f"reduce_scatter {late[0]}") < last_early, events
