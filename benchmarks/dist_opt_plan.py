"""The planner's recommendation for llama-7b on 8, 64 and 512 GPUs (H100 defaults) before and after
megapost's distributed optimizer: the plain planner (DeepSpeed: ZeRO 0-2, any PP), ``--zero-stage 1``
(what ``--use-distributed-optimizer`` ran before: DeepSpeed ZeRO-1) and ``--use-distributed-optimizer``
(the native engine: DistOpt, PP 1). Prints the markdown table of docs/multi-gpu.md. ``--tp-overlap``:
the same before (--no-async-tensor-model-parallel-allreduce: every TP collective exposed) and after
(the default: the backward input-gradient collectives overlapped, megapost.parallel.async_linear).

    python benchmarks/dist_opt_plan.py [--tp-overlap]
"""

from __future__ import annotations

import sys

from megapost.plan.__main__ import parse, plan

GPUS = (8, 64, 512)
CASES = (("DeepSpeed (no flag)", ()), ("--zero-stage 1", ("--zero-stage", "1")),
         ("--use-distributed-optimizer", ("--use-distributed-optimizer",)))
OFF = ("--no-async-tensor-model-parallel-allreduce",)
TP_CASES = (("DeepSpeed, TP overlap off", OFF), ("DeepSpeed (default)", ()),
            ("--use-distributed-optimizer, TP overlap off", ("--use-distributed-optimizer", *OFF)),
            ("--use-distributed-optimizer", ("--use-distributed-optimizer",)))
GiB = 2**30


def main() -> None:
    tp = "--tp-overlap" in sys.argv[1:]
    axis = "TP" if tp else "DP"
    print(f"| GPUs | flags | recommended layout | step s | exposed {axis} s | comm GiB/GPU/step |")
    print("|---|---|---|---|---|---|")
    for gpus in GPUS:
        for name, flags in TP_CASES if tp else CASES:
            best = plan(parse(["--preset", "llama-7b", "--gpus", str(gpus), *flags]))["recommended"]
            print(f"| {gpus} | {name} | {best['label'].strip(' -')} | {best['step_seconds']:.3f} | "
                  f"{best['seconds_by_cause']['tp' if tp else 'dp']:.3f} | {best['comm_gb_per_gpu']:.1f} |")


if __name__ == "__main__":
    main()
