"""Bytes moved per optimizer step by the real trainer on 4 gloo ranks (one thread each) with
``--use-distributed-optimizer`` and the GPU default ``--overlap-grad-reduce``, for four layouts (DP 4 bf16,
DP 4 fp32, TP 2 + SP x DP 2 bf16, PP 2 x DP 2 bf16) at 1, 4 and 8 micro-batches per step, by the axis of
the group each collective ran on, beside the planner's figure for the same layout
(megapost.plan.search.comm_parts; pipeline p2p sends are not collectives and are not counted).

    OMP_NUM_THREADS=1 nice python benchmarks/dist_opt_bytes.py [--json out.json]   # ~10 min on 2 cores

Model: tests/comm_count.MODEL (4 x 256, ffn 768, vocab 256, seq 32), micro-batch 1; rank 0's bytes
(under PP: the first stage, with the embedding). "wire": bytes a rank sends on a ring.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from comm_count import MODEL, run_counts  # noqa: E402
from dist_utils import tiny_config  # noqa: E402

from megapost.plan.memory import Layout  # noqa: E402
from megapost.plan.search import comm_parts  # noqa: E402

MiB = 2**20
MICRO_BATCHES = (1, 4, 8)
WORLD = 4
COMMON = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
LAYOUTS = {  # name -> (tp, pp, flags)
    "DP4 bf16": (1, 1, ["--bf16"]),
    "DP4 fp32": (1, 1, []),
    "TP2+SP x DP2 bf16": (2, 1, ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "PP2 x DP2 bf16": (1, 2, ["--bf16", "--pipeline-model-parallel-size", "2"]),
}


def planned(tp: int, pp: int, bf16: bool, zero: int, m: int) -> dict[str, float]:
    """The planner's per-rank bytes of one optimizer step for this layout (rank 0's stage)."""
    dp = WORLD // (tp * pp)
    lay = Layout(tp, pp, dp, zero, 1, m, False, tp > 1)
    return comm_parts(tiny_config(**MODEL), lay, m * dp, bf16=bf16)


def table(rows: list[dict]) -> None:
    """Print ``rows`` (collected now or read back) beside the planner's figures."""
    print(f"{'layout':>18s} | {'m':>2s} | {'ZeRO':>4s} | {'optimizer':>22s} | {'dp MiB':>7s} | "
          f"{'planner':>7s} | {'ratio':>5s} | calls")
    for r in rows:
        tp, pp, flags = LAYOUTS[r["layout"]]
        plan = planned(tp, pp, "--bf16" in flags, r["zero_stage"], r["micro_batches"])
        dp_wire = r["by_axis"].get("dp", 0.0)
        print(f"{r['layout']:>18s} | {r['micro_batches']:2d} | {r['zero_stage']:4d} | "
              f"{r['optimizer']:>22s} | {dp_wire / MiB:7.2f} | {plan['dp'] / MiB:7.2f} | "
              f"{dp_wire / plan['dp']:5.3f} | {sum(r['calls'].values())}")


AFTER_BUCKET = 500_000  # elements per bucket of the distributed optimizer here (7 buckets)


def after_rows() -> list[dict]:
    """megapost.parallel.dist_optimizer on the same model, DP 4, bf16 and fp32 (tests/dist_opt_train)."""
    from comm_count import install
    from dist_opt_train import count_step
    from dist_utils import run_ranks

    from megapost.parallel.reduce_bytes import dist_optimizer_bytes

    model = {k: MODEL[k] for k in ("vocab_size", "num_layers", "hidden_size", "ffn_hidden_size",
                                   "num_attention_heads", "seq_length")}
    rows = []
    for bf16 in (True, False):
        for r in run_ranks(count_step, WORLD, list(MICRO_BATCHES), bf16, model, AFTER_BUCKET, setup=install,
                           timeout=3600)[0]:
            plan = dist_optimizer_bytes(r["params"], WORLD, bf16).total
            wire = sum(r["wire"].values())
            rows.append({"layout": f"DP4 {'bf16' if bf16 else 'fp32'} DistOpt", **r, "planned": plan})
            print(f"DP4 {'bf16' if bf16 else 'fp32'} DistOpt | m {r['micro_batches']} | "
                  f"{wire / MiB:7.2f} MiB | planner {plan / MiB:7.2f} | ratio {wire / plan:.4f} | "
                  f"calls {r['calls']}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--read", help="print the rows of an earlier --json instead of counting")
    p.add_argument("--after", action="store_true", help="count megapost's distributed optimizer instead")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    o = p.parse_args()
    if o.read:
        table(json.loads(Path(o.read).read_text()))
        return
    if o.after:
        rows = after_rows()
        if o.json:
            Path(o.json).write_text(json.dumps(rows, indent=1))
        return
    cases = [(name, m) for name in o.layouts for m in MICRO_BATCHES]
    rank0 = run_counts([(m, [*LAYOUTS[name][2], *COMMON]) for name, m in cases], dp=WORLD, timeout=3600)[0]
    rows = [{"layout": name, "micro_batches": m, "zero_stage": r["zero_stage"], "optimizer": r["optimizer"],
             "by_axis": r["by_axis"], "calls": r["calls"], "loss": r["loss"]}
            for (name, m), r in zip(cases, rank0, strict=True)]
    table(rows)
    if o.json:
        Path(o.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
