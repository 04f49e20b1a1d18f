"""Bytes moved by collectives per optimizer step of the real trainer at DP2 (gloo, 2 CPU ranks, one
thread each), bf16 ``--overlap-grad-reduce``, for 1, 4 and 8 micro-batches per step: before (ZeRO-2,
which reduces every micro-batch — what bf16 + overlap resolved to until now, still ``--zero-stage 2``)
and after (the resolved default: ZeRO-2 at one micro-batch, ZeRO-1 reducing once otherwise, in buckets
all-reduced during the last micro-batch's backward by megapost.ds_adapter.overlap), beside
the planner's data-parallel term for the same layout (megapost.plan.search.comm_parts).

    OMP_NUM_THREADS=1 python benchmarks/grad_reduce_bytes.py      # ~1.5 min on 2 cores

Model: tests/comm_count.MODEL (4 x 256, ffn 768, vocab 256, seq 32: 3.54M parameters), micro-batch 1.
"wire": bytes a rank sends on a ring (all-reduce 2(n-1)/n of its buffer, all-gather (n-1)/n);
"payload": the buffers handed to the collectives.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from comm_count import MODEL, run_counts  # noqa: E402
from dist_utils import tiny_config  # noqa: E402

from megapost.plan.memory import Layout  # noqa: E402
from megapost.plan.search import comm_parts  # noqa: E402

MiB = 2**20
MICRO_BATCHES = (1, 4, 8)


def main() -> None:
    after = ["--bf16", "--overlap-grad-reduce"]
    before = [*after, "--zero-stage", "2"]
    runs = [(m, f) for f in (before, after) for m in MICRO_BATCHES]
    rank0 = run_counts(runs)[0]
    cfg = tiny_config(**MODEL)
    print(f"DP2 bf16 --overlap-grad-reduce, {rank0[0]['params']:,} parameters, micro-batch 1; MiB per rank "
          "per optimizer step (wire = ring bytes sent; payload = buffers)")
    print(f"{'micro-batches':>13s} | {'before: ZeRO-2 wire (payload)':>30s} | {'planner (before)':>16s} | "
          f"{'after: stage wire (payload)':>30s} | {'planner (after)':>15s} | after/planner")
    n = len(MICRO_BATCHES)
    for b, a in zip(rank0[:n], rank0[n:], strict=True):
        m = a["micro_batches"]
        planned, planned_before = (comm_parts(cfg, Layout(1, 1, 2, z, 1, m), 2 * m, bf16=True)["dp"]
                                   for z in (a["zero_stage"], b["zero_stage"]))
        wb, wa = sum(b["wire"].values()), sum(a["wire"].values())
        pb, pa = sum(b["payload"].values()), sum(a["payload"].values())
        print(f"{m:13d} | {wb / MiB:21.2f} ({pb / MiB:6.2f}) | {planned_before / MiB:16.2f} | "
              f"ZeRO-{a['zero_stage']} {wa / MiB:14.2f} ({pa / MiB:6.2f}) | {planned / MiB:15.2f} | "
              f"{wa / planned:.4f} (before {wb / planned_before:.4f})")
    ratio = sum(rank0[n - 1]["wire"].values()) / sum(rank0[-1]["wire"].values())
    print(f"before / after at {MICRO_BATCHES[-1]} micro-batches: {ratio:.2f}x")


if __name__ == "__main__":
    main()
