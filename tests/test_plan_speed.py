"""The planner's speed model depends on the layout: a saturating MFU in tokens per micro-batch, the
pipeline bubble and the communication it cannot hide (megapost/plan/throughput.py, docs/scaling.md)."""

from __future__ import annotations

import pytest

from megapost.model import ModelConfig
from megapost.plan.memory import Layout, Precision
from megapost.plan.search import candidates
from megapost.plan.throughput import Cluster

CFG = ModelConfig(vocab_size=1024, num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4,
                  seq_length=128)
CLUSTER = Cluster(peak_tflops=100.0, mfu=0.5, mfu_half_tokens=256, gpus_per_node=8, intra_node_gbs=100.0,
                  inter_node_gbs=10.0)


def _find(cands, **want):
    return next(c for c in cands if all(getattr(c.layout, k) == v for k, v in want.items()))


def test_step_time_by_hand_at_dp2_bf16_zero1() -> None:
    """DP2, micro-batch 4 (512 tokens), 2 per step, bf16 ZeRO-1: compute at MFU 0.5 x 512/768; the fp32
    all-reduce of 4P bytes (2 (n-1)/n 4P = 4P sent) overlaps the last micro-batch's backward (2/3 of
    its compute, megapost.ds_adapter.overlap): what exceeds it shows, then the bf16 weight all-gather
    (n-1)/n 2P = P, at 100 GB/s."""
    cands = candidates(CFG, 2, 16, Precision(bf16=True), memory_bytes=80 * 2**30, cluster=CLUSTER,
                       micro_batches=[4])
    c = _find(cands, zero_stage=1, checkpoint=False)
    params = CFG.num_parameters()
    compute = CFG.flops_per_token() * 16 * 128 / (2 * 100e12 * 0.5 * 512 / (512 + 256))
    backward = 2 / 3 * compute / 2
    assert c.step_seconds == pytest.approx(compute + max(0.0, 4 * params / 100e9 - backward)
                                           + params / 100e9, rel=1e-9)


def test_micro_batch_efficiency_and_bubble_rank_layouts() -> None:
    """One GPU: a larger micro-batch is faster (MFU saturates); PP4 pays the 1F1B bubble (pp-1)/m."""
    one = candidates(CFG, 1, 16, Precision(bf16=False), memory_bytes=80 * 2**30, cluster=CLUSTER)
    t = {c.layout.micro_batch: c.step_seconds for c in one if not c.layout.checkpoint}
    assert t[1] > t[2] > t[4] > t[8] > t[16]
    assert t[1] / t[16] == pytest.approx((128 + 256) / 128 * 2048 / (2048 + 256), rel=1e-9)
    pp = candidates(CFG, 4, 16, Precision(bf16=True), memory_bytes=80 * 2**30, cluster=CLUSTER,
                    micro_batches=[1])
    c = _find(pp, pp=4, checkpoint=False)
    assert c.time_parts["bubble"] == pytest.approx(c.time_parts["compute"] * 3 / 16, rel=1e-9)


def test_zero2_per_micro_batch_reduction_costs_across_nodes_not_inside_one() -> None:
    """llama-7b, micro-batch 1, 16 per step: inside a node (DP8, NVLink) ZeRO-2's reduction of every
    micro-batch hides behind backward, as ZeRO-1's one reduction hides behind the last one (a tie);
    across nodes (DP64) ZeRO-2's do not, and ZeRO-1's one reduction per step wins, as the trainer
    resolves it."""
    from megapost.plan.__main__ import model_config, parse

    cfg = model_config(parse(["--preset", "llama-7b", "--gpus", "8"]))
    h100 = Cluster()
    for gpus, zero2_slower in ((8, False), (64, True)):
        cands = candidates(cfg, gpus, 16 * gpus, Precision(bf16=True), memory_bytes=1e15, cluster=h100,
                           micro_batches=[1])
        z1, z2 = (_find(cands, tp=1, pp=1, zero_stage=z, checkpoint=False) for z in (1, 2))
        assert (z2.step_seconds > z1.step_seconds * 1.01) == zero2_slower, (gpus, z1.time_parts,
                                                                           z2.time_parts)
        assert z1.step_seconds <= z2.step_seconds


def test_tied_layouts_are_said(capsys) -> None:
    """With a constant MFU (--mfu-half-tokens 0) on one GPU every micro-batch without checkpointing takes
    the same time (5 micro-batches x bf16's ZeRO-1 and ZeRO-2): the planner says that these 10 tie
    instead of implying a ranking."""
    from megapost.plan.__main__ import main as plan_main

    plan_main(["--preset", "tiny-cpu", "--gpus", "1", "--mfu-half-tokens", "0"])
    assert "10 fitting layouts are predicted within 0.5% of it: the model does not rank them" in (
        capsys.readouterr().out)
    plan_main(["--preset", "tiny-cpu", "--gpus", "1"])  # MFU saturating: only ZeRO-1/2 of mb16 tie (DP1)
    assert "  2 fitting layouts are predicted within 0.5%" in capsys.readouterr().out


@pytest.mark.parametrize("sp", [False, True])
def test_tp_backward_overlap_hides_the_column_gradient_collectives(sp: bool) -> None:
    """TP 2, one micro-batch of 512 tokens, 4 layers: every TP collective shows without the overlap
    (--no-async-tensor-model-parallel-allreduce); with it, the column-parallel input-gradient collectives
    (half of the bytes; a quarter under SP) are hidden up to the weight-gradient GEMMs of Q/K/V and
    W_1/W_3 (2 h (3 h + 2 ffn) / 2 FLOPs per token and layer on each rank): behind slow links only that
    GEMM time, behind fast ones all of the overlapped part."""
    from megapost.plan.search import comm_parts
    from megapost.plan.throughput import step_parts

    lay = dict(tp=2, pp=1, dp=1, zero_stage=0, micro_batch=4, grad_accum=1, sequence_parallel=sp)
    mfu = 0.5 * 512 / (512 + 256)
    gemm_s = 2 * 256 * (3 * 256 + 2 * 768) / 2 * 512 * 4 / (100e12 * mfu)
    share = 0.25 if sp else 0.5
    for gbs in (0.001, 100.0):  # links much slower / faster than the GEMMs
        cluster = Cluster(peak_tflops=100.0, mfu=0.5, intra_node_gbs=gbs)
        on, off = (Layout(**lay, tp_overlap=o) for o in (True, False))
        comm = comm_parts(CFG, on, 4, True)
        tp_on = step_parts(CFG, on, 4, True, cluster, comm)["tp"]
        tp_off = step_parts(CFG, off, 4, True, cluster, comm)["tp"]
        assert tp_off == pytest.approx(comm["tp"] / (gbs * 1e9), rel=1e-12)
        assert tp_off - tp_on == pytest.approx(min(share * tp_off, gemm_s), rel=1e-9)
    assert share * tp_off < gemm_s < share * comm["tp"] / 1e6  # both regimes were exercised
