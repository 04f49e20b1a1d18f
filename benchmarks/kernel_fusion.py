"""Step time of megapost's real Trainer with the fused kernels (``--kernel-fusion``) against the unfused
path, each case in a fresh process, cases interleaved over rounds; prints each case's median seconds
per step, wall clock and process CPU time (on a shared CPU the process time is the steadier figure),
and the ratios to the first case (below 1: the fusion is faster).

    python benchmarks/kernel_fusion.py [--cases none,auto] [--bf16] [--rounds 3] [--steps 4]
        [--layers 4 --hidden 256 --seq 128 --micro 4 --accum 2 --vocab 2048] [--json OUT]

On CPU the ratio measures host dispatch plus CPU kernels; on a GPU it is the figure the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import add_model_args


def one_case(o: argparse.Namespace) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds per step of ``o.steps`` steps after ``o.warmup``, in this process."""
    import torch
    from bench_common import build_trainer

    extra = ["--kernel-fusion", o.case, "--num-attention-heads", "4", "--log-interval", "1000"]
    trainer, _cfg, _args = build_trainer(o, [*extra, *(["--bf16"] if o.bf16 else [])])
    cuda = trainer.device.type == "cuda"
    times = []
    for step in range(1, o.warmup + o.steps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    trainer.close()
    return times[o.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(seq=128, vocab=2048)
    p.add_argument("--cases", default="none,auto", help="comma list of --kernel-fusion values ('+' for ',')")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--case", help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.case:
        print(json.dumps(one_case(o)))
        return
    cases = [c.replace("+", ",") for c in o.cases.split(",")]
    passthrough = [a for a in sys.argv[1:] if a not in ("--json", o.json)]
    times: dict[str, list[list[float]]] = {c: [] for c in cases}
    for _ in range(o.rounds):
        for case in cases:
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--case", case], text=True,
                                  capture_output=True, env={**os.environ}, timeout=1800)
            if proc.returncode != 0:
                sys.exit(f"case {case} failed:\n{proc.stderr[-3000:]}")
            times[case] += json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {}
    for c, t in times.items():
        wall, cpu = statistics.median(w for w, _ in t), statistics.median(p for _, p in t)
        rows[c] = {"median_s": wall, "median_cpu_s": cpu, "steps": t}
    for c, r in rows.items():
        r["ratio_to_first"] = r["median_s"] / rows[cases[0]]["median_s"]
        r["cpu_ratio_to_first"] = r["median_cpu_s"] / rows[cases[0]]["median_cpu_s"]
        print(f"--kernel-fusion {c:24s} wall {r['median_s'] * 1e3:8.1f} ms/step "
              f"(ratio {r['ratio_to_first']:.3f})  process CPU {r['median_cpu_s'] * 1e3:8.1f} ms/step "
              f"(ratio {r['cpu_ratio_to_first']:.3f})")
    if o.json:
        Path(o.json).write_text(json.dumps({"args": vars(o), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
