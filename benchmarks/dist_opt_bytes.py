"""Bytes moved per optimizer step by the real trainer on 4 gloo ranks (one thread each), before and after
megapost's distributed optimizer: DeepSpeed's ZeRO-1 path (``--zero-stage 1`` fp32, the bf16 default
with ``--overlap-grad-reduce``) and the native engine (``--use-distributed-optimizer``, buckets of 500 k
elements), for DP 4 bf16, DP 4 fp32, TP 2 + SP x DP 2 bf16 and PP 2 x DP 2 bf16 (the native engine's
pipeline: megapost.native.pipeline) at 1, 4 and 8 micro-batches per step, by the axis of the group
each collective ran on, beside the planner's figure for the same layout (megapost.plan.search.comm_parts;
pipeline p2p sends are not collectives and are not counted).

    OMP_NUM_THREADS=1 nice python benchmarks/dist_opt_bytes.py --json before.json            # ~12 min
    OMP_NUM_THREADS=1 nice python benchmarks/dist_opt_bytes.py --after --json after.json     # ~8 min
    python benchmarks/dist_opt_bytes.py --read before.json --read after.json                 # the tables

The sequence-parallel norm gains on DeepSpeed's path, one TP all-reduce per gain per micro-batch (before)
and once per step in one all-reduce (now, megapost.ds_adapter.partial_sums):

    OMP_NUM_THREADS=1 nice python benchmarks/dist_opt_bytes.py --layouts "TP2+SP x DP2 bf16" \
        "TP2+SP x DP2 fp32" [--per-micro-batch-gains] --json gains.json                      # ~6 min

Model: tests/comm_count.MODEL (4 x 256, ffn 768, vocab 256, seq 32), micro-batch 1; rank 0's bytes
(under PP: the first stage, with the embedding). "wire": bytes a rank sends on a ring.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from comm_count import MODEL, count_runs  # noqa: E402
from dist_utils import run_ranks, tiny_config  # noqa: E402
from native_train import counted_native_setup  # noqa: E402

from megapost.plan.memory import Layout  # noqa: E402
from megapost.plan.search import comm_parts  # noqa: E402

MiB = 2**20
MICRO_BATCHES = (1, 4, 8)
WORLD = 4
TP2SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # name -> (tp, pp, flags before, flags after or None)
    "DP4 bf16": (1, 1, ["--bf16", "--overlap-grad-reduce"], ["--bf16"]),
    "DP4 fp32": (1, 1, ["--zero-stage", "1", "--overlap-grad-reduce"], []),
    "TP2+SP x DP2 bf16": (2, 1, ["--bf16", "--overlap-grad-reduce", *TP2SP], ["--bf16", *TP2SP]),
    "TP2+SP x DP2 fp32": (2, 1, ["--zero-stage", "1", *TP2SP], [*TP2SP]),
    "PP2 x DP2 bf16": (1, 2, ["--bf16", "--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"],
                       ["--bf16", "--pipeline-model-parallel-size", "2"]),
}


def per_micro_batch_gains_setup() -> None:
    """``run_ranks`` setup: counted, and DeepSpeed's path with the per-micro-batch gain all-reduces."""
    import megapost.train.build as build

    counted_native_setup()
    build.DEFER_SP_GAINS = False


def planned(tp: int, pp: int, bf16: bool, zero: int | str, m: int) -> dict[str, float]:
    """The planner's per-rank bytes of one optimizer step for this layout (rank 0's stage)."""
    dp = WORLD // (tp * pp)
    native = zero == "native"
    lay = Layout(tp, pp, dp, 1 if native else int(zero), 1, m, False, tp > 1, distributed_optimizer=native)
    return comm_parts(tiny_config(**MODEL), lay, m * dp, bf16=bf16)


def table(rows: list[dict]) -> None:
    """Print ``rows`` (collected now or read back) beside the planner's figures."""
    print(f"{'layout':>18s} | {'m':>2s} | {'ZeRO':>6s} | {'optimizer':>22s} | {'dp MiB':>7s} | "
          f"{'planner':>7s} | {'ratio':>6s} | calls")
    for r in rows:
        tp, pp, flags, _ = LAYOUTS[r["layout"]]
        plan = planned(tp, pp, "--bf16" in flags, r["zero_stage"], r["micro_batches"])
        dp_wire = r["by_axis"].get("dp", 0.0)
        print(f"{r['layout']:>18s} | {r['micro_batches']:2d} | {r['zero_stage']!s:>6s} | "
              f"{r['optimizer']:>22s} | {dp_wire / MiB:7.2f} | {plan['dp'] / MiB:7.2f} | "
              f"{dp_wire / plan['dp']:6.4f} | {sum(r['calls'].values())} {r['calls']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--read", action="append", help="print the rows of an earlier --json instead of counting")
    p.add_argument("--after", action="store_true", help="the native engine (--use-distributed-optimizer)")
    p.add_argument("--per-micro-batch-gains", action="store_true",
                   help="DeepSpeed's path as before: each SP norm gain all-reduced over TP every micro-batch")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    o = p.parse_args()
    if o.read:
        for path in o.read:
            table(json.loads(Path(path).read_text()))
        return
    names = [n for n in o.layouts if not o.after or LAYOUTS[n][3] is not None]
    cases = [(name, m) for name in names for m in MICRO_BATCHES]
    runs = [(m, [*LAYOUTS[name][3], "--use-distributed-optimizer"] if o.after else LAYOUTS[name][2])
            for name, m in cases]
    setup = per_micro_batch_gains_setup if o.per_micro_batch_gains else counted_native_setup
    rank0 = run_ranks(count_runs, WORLD, runs, setup=setup, timeout=3600)[0]
    rows = [{"layout": name, "micro_batches": m, "zero_stage": r["zero_stage"], "optimizer": r["optimizer"],
             "by_axis": r["by_axis"], "calls": r["calls"], "loss": r["loss"], "buckets": r["overlap_buckets"]}
            for (name, m), r in zip(cases, rank0, strict=True)]
    table(rows)
    if o.json:
        Path(o.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
