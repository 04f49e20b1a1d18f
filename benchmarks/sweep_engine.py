"""Runs per hour of the stability sweep's engines on the same fixed cells, and what flushing denormals
changes.

    python benchmarks/sweep_engine.py --data-path data/bpe2k/news2k_text_document \\
        --tokenizer-model data/bpe2k/bpe2k.model --out runs/bench_engine

Runs the same cells (default: the boundary study's d 64 x 4 layers, warmup 20, 150 steps, seq 32, batch 8
at lr 3e-3 and 1e-2, seed 1) three times through tools/stability_sweep.py: ``--engine subprocess``
(one process per run: the reference), ``--engine persistent``, and ``--engine persistent
--flush-denormal``. Prints per mode the wall time, the CPU seconds of the sweep and all its children
(a fair measure on a shared machine, where wall time depends on the others' load), runs/hour by each,
the ratios to the reference, and per cell whether the per-step metrics are bit-identical to the
reference and the outcome / final loss of each mode.
"""

from __future__ import annotations

import argparse
import csv
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"subprocess": ["--engine", "subprocess"], "persistent": ["--engine", "persistent"],
         "persistent+flush": ["--engine", "persistent", "--flush-denormal"]}


def children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--out", required=True, help="one sweep folder per mode under it (delete to re-measure)")
    p.add_argument("--lrs", default="3e-3,1e-2")
    p.add_argument("--seeds", default="1")
    p.add_argument("--jobs", default="1")
    p.add_argument("--nice", default="10")
    args, cell_flags = p.parse_known_args()
    cell_flags = cell_flags or ["--hidden", "64", "--depths", "4", "--warmups", "20", "--iters", "150",
                                "--seq-length", "32", "--batch", "8", "--interval", "4"]
    stats = {}
    for mode, flags in MODES.items():
        out = Path(args.out) / mode.replace("+", "_")
        cmd = [sys.executable, str(REPO / "tools" / "stability_sweep.py"), "--out", str(out), "--data-path",
               args.data_path, "--tokenizer-model", args.tokenizer_model, "--variants", "post", "--lrs",
               args.lrs, "--seeds", args.seeds, "--jobs", args.jobs, "--nice", args.nice, *cell_flags, *flags]
        cpu, start = children_cpu(), time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall, cpu = time.monotonic() - start, children_cpu() - cpu
        rows = list(csv.DictReader(open(out / "results.csv", encoding="utf-8")))
        stats[mode] = {"wall": wall, "cpu": cpu, "runs": len(rows), "out": out, "rows": rows}
    ref = stats["subprocess"]
    for mode, s in stats.items():
        n = s["runs"]
        print(f"{mode:17s} {n} runs: wall {s['wall']:7.0f} s ({3600 * n / s['wall']:6.1f} runs/h, "
              f"x{ref['wall'] / s['wall']:.2f}), CPU {s['cpu']:7.0f} s ({3600 * n / s['cpu']:6.1f} runs "
              f"per CPU-hour, x{ref['cpu'] / s['cpu']:.2f})")
    jsonl = Path("tensorboard") / "collapse_metrics.jsonl"
    for cell in sorted(p.name for p in (ref["out"] / "cells").iterdir()):
        ref_bytes = (ref["out"] / "cells" / cell / jsonl).read_bytes()
        same = {m: (s["out"] / "cells" / cell / jsonl).read_bytes() == ref_bytes
                for m, s in stats.items() if m != "subprocess"}
        fates = {}
        for m, s in stats.items():
            row = next(r for r in s["rows"]
                       if f"_lr{float(r['lr']):g}_" in cell and cell.endswith(f"_s{r['seed']}"))
            fates[m] = (f"{row['outcome']} (collapsed={row['collapsed']}) final loss "
                        f"{float(row['final_loss']):.6f}")
        print(f"{cell}: bit-identical to subprocess: {same}; "
              + "; ".join(f"{m}: {f}" for m, f in fates.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
