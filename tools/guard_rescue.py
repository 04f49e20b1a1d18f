"""P(rescued) per guard remedy: the guarded sweeps against the unguarded one over the same seeds.

    python tools/guard_rescue.py --unguarded runs/scaling_study/outcomes \\
        --guarded 'lr*0.5=runs/scaling_study/guard_delayed_lr05' \\
        --guarded rewarm=runs/scaling_study/guard_delayed_rewarm

Reads each sweep's ``results.csv`` (tools/stability_sweep.py). A seed is *at risk* when its unguarded
Post-Norm run ends collapsed; it is *rescued* when the guarded run of that seed ends trained (a plateau is
counted apart: not collapsed, not trained). Per remedy: rescued / at risk with its Wilson 95 % interval,
P(collapsed) over every seed the guarded sweep ran, and the final gap (final loss - frequency loss) mean of
the guarded, the unguarded and the Pre-Norm twin runs (``pre`` rows of the unguarded sweep, when present).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from collapse_metrics.analysis.probabilities import wilson
from placement_table import load_sweep

from megapost.utils.atomic import atomic_write_text

Rows = dict[int, dict[str, object]]


def read(folder: str, variant: str, flag: str, name: str) -> Rows:
    """seed -> typed row of ``variant`` in ``folder``/results.csv (placement_table's reader)."""
    return {int(r["seed"]): r for r in load_sweep(name, Path(folder), flag) if r["variant"] == variant}


def _gap(rows: Sequence[dict[str, object]]) -> str:
    gaps = [float(r["final_gap"]) for r in rows if not math.isnan(float(r["final_gap"]))]
    return f"{statistics.fmean(gaps):+.2f}" if gaps else "–"


def rescue_rows(unguarded: Rows, guarded: Rows) -> dict[str, list[int]]:
    """The counts of one remedy over the seeds both sweeps ran."""
    seeds = sorted(set(unguarded) & set(guarded))
    risk = [s for s in seeds if unguarded[s]["outcome"] == "collapsed"]
    rescued = [s for s in risk if guarded[s]["outcome"] == "trained"]
    plateau = [s for s in risk if guarded[s]["outcome"] == "plateau"]
    collapsed = [s for s in seeds if guarded[s]["outcome"] == "collapsed"]
    return {"seeds": seeds, "risk": risk, "rescued": rescued, "plateau": plateau, "collapsed": collapsed}


def table(args: argparse.Namespace) -> str:
    unguarded = read(args.unguarded, args.variant, "--unguarded", "")
    pre = read(args.unguarded, "pre", "--unguarded", "")
    lines = ["| remedy | rescued / collapsing unguarded | to a plateau | P(collapsed) guarded | unguarded | "
             "final gap guarded | unguarded | Pre-Norm twin |", "|---|---|---|---|---|---|---|---|"]
    for spec in args.guarded:
        name, _, folder = spec.partition("=")
        guarded = read(folder, args.variant, "--guarded", name)
        r = rescue_rows(unguarded, guarded)
        seeds = r["seeds"]
        k, n = len(r["rescued"]), len(r["risk"])
        lo, hi = wilson(k, n)
        c = len(r["collapsed"])
        clo, chi = wilson(c, len(seeds))
        u = sum(unguarded[s]["outcome"] == "collapsed" for s in seeds)
        lines.append(
            f"| `{name}` | {k}/{n} [{lo:.2f}, {hi:.2f}] (seeds {','.join(map(str, r['rescued'])) or '-'}) | "
            f"{len(r['plateau'])} | {c}/{len(seeds)} [{clo:.2f}, {chi:.2f}] | {u}/{len(seeds)} | "
            f"{_gap([guarded[s] for s in seeds])} | {_gap([unguarded[s] for s in seeds])} | "
            f"{_gap([pre[s] for s in seeds if s in pre])} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unguarded", required=True, help="the unguarded sweep folder (with its Pre-Norm twins)")
    p.add_argument("--guarded", action="append", required=True, metavar="NAME=FOLDER")
    p.add_argument("--variant", default="post")
    p.add_argument("--out", help="also write the table here (markdown)")
    args = p.parse_args(argv)
    try:
        text = table(args)
    except SystemExit as e:  # load_sweep's one line
        print(e, file=sys.stderr)
        return 2
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        atomic_write_text(Path(args.out), text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
