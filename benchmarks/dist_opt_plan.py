"""The planner's recommendation for llama-7b on 8, 64 and 512 GPUs (H100 defaults) before and after
megapost's distributed optimizer: the plain planner (DeepSpeed: ZeRO 0-2, any PP), ``--zero-stage 1``
(what ``--use-distributed-optimizer`` ran before: DeepSpeed ZeRO-1) and ``--use-distributed-optimizer``
(the native engine: DistOpt, PP 1). Prints the markdown table of docs/multi-gpu.md.

    python benchmarks/dist_opt_plan.py
"""

from __future__ import annotations

from megapost.plan.__main__ import parse, plan

GPUS = (8, 64, 512)
CASES = (("DeepSpeed (no flag)", ()), ("--zero-stage 1", ("--zero-stage", "1")),
         ("--use-distributed-optimizer", ("--use-distributed-optimizer",)))
GiB = 2**30


def main() -> None:
    print("| GPUs | flags | recommended layout | step s | exposed DP s | comm GiB/GPU/step |")
    print("|---|---|---|---|---|---|")
    for gpus in GPUS:
        for name, flags in CASES:
            best = plan(parse(["--preset", "llama-7b", "--gpus", str(gpus), *flags]))["recommended"]
            print(f"| {gpus} | {name} | {best['label'].strip(' -')} | {best['step_seconds']:.3f} | "
                  f"{best['seconds_by_cause']['dp']:.3f} | {best['comm_gb_per_gpu']:.1f} |")


if __name__ == "__main__":
    main()
