"""Training-run figures (Figs 3-6 and a t_sim heatmap) from a run's collapse_metrics.jsonl.

    python tools/plot_collapse.py --run-dir runs/X/tensorboard --out docs/figures/X

Writes fig3_alpha.png (alpha_k^l over steps), fig4_contraction.png (sqrt(d)/||y|| and c around the
transition window), fig5_grad_norms.png (per-layer gradient norms, log), fig6_loss_vs_frequency.png and
tsim_heatmap.png, and prints (--summary: writes) the loss vs the frequency losses, the last-layer
t_sim and the layer-1/layer-L gradient-norm ratio over the last measured steps. The window is the
steps flagged ``transition`` +/- --window, or the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from collapse_metrics.analysis.figures import plot_collapse_run
from collapse_metrics.analysis.runs import load_collapse_jsonl, summarize

from megapost.utils.atomic import atomic_write_text

JSONL = "collapse_metrics.jsonl"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help=f"the run's --tensorboard-dir ({JSONL}) or the file")
    p.add_argument("--out", required=True, help="folder for the PNGs")
    p.add_argument("--window", type=int, default=50, help="steps either side of the transition")
    p.add_argument("--summary", metavar="PATH", help="also write the printed summary as JSON here")
    p.add_argument("--frequency-json", action="append", default=[], metavar="PATH",
                   help="tools/frequency_loss.py output drawn as a reference line in Fig 6 (repeatable)")
    args = p.parse_args(argv)
    path = Path(args.run_dir)
    path = path / JSONL if path.is_dir() else path
    if not path.is_file():
        print(f"error: {path} not found (run with --plugins collapse_metrics?)", file=sys.stderr)
        return 2
    refs = {}
    for ref in args.frequency_json:
        res = json.loads(Path(ref).read_text())
        refs[f"frequency loss: {res['scope']} scope, {res['num_tokens']:,} tokens"] = res["aggregated"]
    for name, png in plot_collapse_run(path, args.out, args.window, refs).items():
        print(f"{name}: {png}")
    summary = summarize(load_collapse_jsonl(path))
    if args.summary:
        atomic_write_text(args.summary, json.dumps(summary, indent=1) + "\n")
    print("last measured steps: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items() if v is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
