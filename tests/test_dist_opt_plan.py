"""The planner prices megapost's distributed optimizer (``--use-distributed-optimizer``): one reduce-scatter
and one weight all-gather per step, the reduce-scatter hidden behind the last micro-batch's backward and
the gather behind the next step's first forward, except what exceeds them."""

from __future__ import annotations

import math

from megapost.model import ModelConfig
from megapost.parallel.reduce_bytes import dist_optimizer_bytes
from megapost.plan.counts import stage_parameters
from megapost.plan.memory import Layout, Precision
from megapost.plan.search import candidates, comm_parts
from megapost.plan.throughput import Cluster, step_parts

CFG = ModelConfig(vocab_size=32000, num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                  num_attention_heads=32, seq_length=4096)


def test_bytes_are_one_reduce_scatter_and_one_gather() -> None:
    # 1000 parameters, DP 4: (3/4) * 4 B fp32 gradients + (3/4) * 2 B bf16 weights
    b = dist_optimizer_bytes(1000, 4, bf16=True)
    assert (b.gradients, b.gather, b.total, b.reductions) == (3000.0, 1500.0, 4500.0, 1)
    assert dist_optimizer_bytes(1000, 4, bf16=True, reduce_in_bf16=True).gradients == 1500.0
    assert dist_optimizer_bytes(1000, 4, bf16=False).total == 6000.0
    assert dist_optimizer_bytes(1000, 1, bf16=True).total == 0.0


def test_comm_and_exposed_time_of_the_distributed_optimizer() -> None:
    lay = Layout(1, 1, 64, 1, 1, 8, distributed_optimizer=True)
    params = stage_parameters(CFG, 1, 1, 0)
    dp = comm_parts(CFG, lay, 512, bf16=True)["dp"]
    assert dp == 63 / 64 * 6 * params  # vs ZeRO-1 bf16's 2(63/64)*4P + (63/64)*2P
    zero1 = comm_parts(CFG, Layout(1, 1, 64, 1, 1, 8), 512, bf16=True)["dp"]
    assert abs(zero1 / dp - 10 / 6) < 1e-12
    fast, slow = Cluster(inter_node_gbs=5000.0), Cluster(inter_node_gbs=0.5)
    assert step_parts(CFG, lay, 512, True, fast, {"tp": 0, "pp": 0, "dp": dp})["dp"] == 0.0
    parts = step_parts(CFG, lay, 512, True, slow, {"tp": 0, "pp": 0, "dp": dp})
    # at 0.5 GB/s the reduce-scatter (42 GB) and gather (21 GB) far exceed one micro-batch's compute
    forward = parts["compute"] / 3 / 8
    expected = (63 / 64 * 4 * params / 0.5e9 - 2 * forward) + (63 / 64 * 2 * params / 0.5e9 - forward)
    assert abs(parts["dp"] / expected - 1) < 1e-9


def test_candidates_offer_it_only_when_asked() -> None:
    kw = dict(memory_bytes=80 * 2**30, micro_batches=[1])
    plain = candidates(CFG, 64, 512, Precision(), **kw)
    dist = candidates(CFG, 64, 512, Precision(), distributed_optimizer=True, **kw)
    assert not any(c.layout.distributed_optimizer for c in plain)
    ours = [c for c in dist if c.layout.distributed_optimizer]
    assert ours and all(c.layout.zero_stage == 1 and c.layout.dp > 1 for c in ours)
    assert "DistOpt" in ours[0].layout.label()


def test_cli_prices_the_flag_as_the_native_engine(capsys) -> None:
    """``--use-distributed-optimizer`` runs megapost's native engine (megapost.native), so the CLI prices its
    layouts as the distributed optimizer (DistOpt at DP > 1, any PP, the interleaved schedule only there)
    and says so; at 64 GPUs it exposes less data-parallel time than ZeRO-1's best layout."""
    import json

    from megapost.plan.__main__ import main as plan_main

    def plan(*flags: str) -> dict:
        plan_main(["--preset", "llama-7b", "--gpus", "64", *flags, "--json"])
        return json.loads(capsys.readouterr().out)

    ours, zero1 = plan("--use-distributed-optimizer"), plan("--zero-stage", "1")
    rows = ours["fitting"] + ours["not_fitting"]
    assert all(r["layout"]["zero_stage"] == 1 for r in rows) and any(r["layout"]["pp"] > 1 for r in rows)
    assert any(r["layout"]["virtual"] > 1 for r in rows)
    assert all(r["layout"]["distributed_optimizer"] for r in rows if r["layout"]["virtual"] > 1)
    assert not any(r["layout"]["virtual"] > 1 for r in zero1["fitting"] + zero1["not_fitting"])
    assert all(r["layout"]["distributed_optimizer"] == (r["layout"]["dp"] > 1) for r in rows)
    assert not any(r["layout"]["distributed_optimizer"] for r in zero1["fitting"] + zero1["not_fitting"])
    assert ours["recommended"]["layout"]["distributed_optimizer"]
    assert ours["recommended"]["seconds_by_cause"]["dp"] < zero1["recommended"]["seconds_by_cause"]["dp"]
    assert any("megapost's native engine" in n for n in ours["notes"]) and not zero1["notes"]
    plan_main(["--preset", "llama-7b", "--gpus", "64", "--use-distributed-optimizer"])
    assert "DistOpt" in capsys.readouterr().out


def test_interleaved_schedule_priced_bubble_and_sends() -> None:
    """llama-7b-shaped (``CFG``), TP 1 PP 4 DP 2, 8 micro-batches: v = 2 virtual stages per rank against
    1F1B — the bubble is compute x (pp - 1) / (m v) = compute x 3/16 (1F1B: 3/8), the pipeline's bytes
    twice 1F1B's (every
    chunk boundary crosses ranks: 2 x 2 x tokens x h x 2 B per rank, computed here), the compute the
    same, the first stage's activations more (1 + 3/8 of the micro-batches in flight)."""
    from megapost.plan.memory import rank_memory

    cfg = CFG
    one, two = (Layout(1, 4, 2, 1, 1, 8, distributed_optimizer=True, virtual=v) for v in (1, 2))
    c1, c2 = (comm_parts(cfg, lay, 16, bf16=True) for lay in (one, two))
    tokens = 8 * cfg.seq_length  # per data-parallel rank: 16 / 2 sequences
    assert c1["pp"] == 2 * tokens * cfg.hidden_size * 2 and c2["pp"] == 2 * c1["pp"]
    p1, p2 = (step_parts(cfg, lay, 16, True, Cluster(), c) for lay, c in ((one, c1), (two, c2)))
    assert p1["compute"] == p2["compute"]
    assert math.isclose(p1["bubble"], p1["compute"] * 3 / 8, rel_tol=1e-12)
    assert math.isclose(p2["bubble"], p1["compute"] * 3 / 16, rel_tol=1e-12)
    m1, m2 = (rank_memory(cfg, lay, Precision())[0] for lay in (one, two))
    assert m2.activations > m1.activations
