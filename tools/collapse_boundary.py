"""The collapse boundary's scaling law: lr*(d, L), the peak lr at which P(collapse) = 1/2.

    python tools/collapse_boundary.py --out runs/collapse_boundary \\
        --data-path data/bpe2k/news2k_text_document --tokenizer-model data/bpe2k/bpe2k.model
    # default grid: widths 64,128,256 x depths 4,8,16, 3 seeds, ends + widening + 3 bisection steps
    # (150 runs, 40 min at --jobs 2 on 2 cores)

For every (width, depth) of the grid, at fixed warmup, steps, sequence length and batch, the peak lr is
bisected in log-lr between --lr-lo and --lr-hi (both ends first; an end on the wrong side moves out by
--lr-widen, within [--lr-min, --lr-max], until the bracket holds; then --bisect-steps midpoints), each
probe over --seeds; a probe "collapses" when >= half its seeds end in the collapsed state (outcome.py's
collapsed, with vanished gradients: --collapse-grad-ratio). Every probe is
one stability_sweep cell (the real trainer, resumable: <out>/d{width}/cells/...; all grid points advance
in lock-step so --jobs processes stay busy). Then lr*(d, L) = a d^b L^c is fitted (study/bisection.py,
intervals from the brackets), plotted (<out>/boundary.png), extrapolated to the ladder presets (labelled
extrapolation), and written to <out>/boundary.json; ``megapost-law boundary
<out>/boundary.json`` fits the planner's law from it (maximum likelihood over every probe's seeds).
<out>/verify.sh lists the GPU runs that would test the prediction at the next size,
with their planned cost. Flags after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from collapse_metrics.corpus import train_split_frequency_loss
from stability_sweep import Cell, add_run_flags, ints, parse_variant, run_cell
from sweep_engine import make_pool, run_probes
from sweep_results import collapsed, write_csv

from megapost.config.presets import PRESETS
from megapost.data import SentencePieceTokenizer
from megapost.model import ModelConfig
from megapost.study.bisection import Bracket, fit_power_law, predict
from megapost.train.plugin_services import Corpus
from megapost.utils.atomic import atomic_write_text

LADDER = ("llama-350m", "llama-760m", "llama-1.3b", "llama-3b", "llama-7b", "paper-180m")
H100_BF16_TFLOPS, PLANNED_MFU = 989.0, 0.3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--data-path", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--variant", default="post", help="a stability_sweep variant (placement[+flag...])")
    p.add_argument("--widths", type=ints, default=[64, 128, 256])
    p.add_argument("--depths", type=ints, default=[4, 8, 16])
    p.add_argument("--seeds", type=ints, default=[1, 2, 3])
    p.add_argument("--lr-lo", type=float, default=3e-3)
    p.add_argument("--lr-hi", type=float, default=1e-1)
    p.add_argument("--lr-from-law", metavar="FIT", default=None,
                   help="start each point's bracket at FIT's lr*(d, L) x [1/F, F] (a boundary.json, e.g. "
                   "study/results/grid_w20/boundary.json) instead of [--lr-lo, --lr-hi]")
    p.add_argument("--law-factor", type=float, default=2.0, metavar="F", help="see --lr-from-law")
    p.add_argument("--adaptive-seeds", action=argparse.BooleanOptionalAction, default=True,
                   help="stop a probe's seeds once its majority vote cannot change (seeds in order)")
    p.add_argument("--lr-widen", type=float, default=10.0,
                   help="factor an end moves out by when both ends collapse (or neither does)")
    p.add_argument("--lr-min", type=float, default=1e-5, help="no probe below this: status 'below'")
    p.add_argument("--lr-max", type=float, default=1.0, help="no probe above this: status 'above'")
    p.add_argument("--bisect-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--split", default="969,30,1")
    add_run_flags(p)
    p.add_argument("--presets", default=",".join(LADDER), help="presets to extrapolate to")
    p.add_argument("--plot-only", action="store_true", help="refit/replot from <out>/brackets.json")
    return p


def _cell_args(args: argparse.Namespace, width: int) -> argparse.Namespace:
    a = copy.copy(args)
    a.hidden, a.out = width, str(Path(args.out) / f"d{width}")
    return a


def probe(args: argparse.Namespace, points: list[Bracket], freq: float) -> None:
    """One lock-step round: every open point's next lrs over the seeds (adaptive: until the vote is
    decided), then each bracket is narrowed; results.csv holds every run so far."""
    jobs = {(i, lr): list(args.seeds) for i, b in enumerate(points) for lr in b.next_lrs()}
    start = time.monotonic()

    def one(key: tuple[int, float], seed: int) -> dict | None:
        b = points[key[0]]
        cell = Cell(args.variant, b.depth, key[1], args.warmup, seed)
        result = run_cell(_cell_args(args, b.width), cell, freq)
        if result is not None:
            with args.rows_lock:
                args.rows[(b.width, b.depth, key[1], seed)] = result
                write_csv(Path(args.out) / "results.csv", [args.rows[k] for k in sorted(args.rows)])
        return result

    decided = run_probes(jobs, one, lambda r: collapsed(r, args.collapse_grad_ratio), args.jobs,
                         args.adaptive_seeds)
    for (i, lr), done in decided.items():
        b = points[i]
        b.record(lr, sum(collapsed(r, args.collapse_grad_ratio) for r in done), len(done))
        print(f"[boundary] d={b.width} L={b.depth} lr {lr:.4g}: {b.probes[-1]['k']}/{len(done)} collapsed "
              f"-> [{b.lo:.4g}, {b.hi:.4g}] {b.status}", flush=True)
    runs = sum(len(d) for d in decided.values())
    print(f"[boundary] round: {runs} runs in {time.monotonic() - start:.0f} s", flush=True)


def start_brackets(args: argparse.Namespace) -> list[Bracket]:
    """Every grid point's first bracket: [--lr-lo, --lr-hi], or the law's lr* x [1/F, F]."""
    fit = json.loads(Path(args.lr_from_law).read_text(encoding="utf-8"))["fit"] if args.lr_from_law else None
    points = []
    for w in args.widths:
        for d in args.depths:
            lo, hi = args.lr_lo, args.lr_hi
            if fit is not None:
                star = predict(fit, w, d)["lr_star"]
                lo, hi = float(f"{star / args.law_factor:.4g}"), float(f"{star * args.law_factor:.4g}")
            points.append(Bracket(w, d, lo, hi, steps=args.bisect_steps, widen=args.lr_widen,
                                  lr_min=args.lr_min, lr_max=args.lr_max))
    return points


def preset_rows(fit: dict, names: Sequence[str]) -> list[dict]:
    rows = []
    for name in names:
        p = PRESETS[name]
        pred = predict(fit, p["hidden_size"], p["num_layers"])
        rows.append({"preset": name, "width": p["hidden_size"], "depth": p["num_layers"],
                     "preset_lr": p["lr"], **pred,
                     "label": "inside the fitted range" if pred["inside"] else "extrapolation"})
    return rows


def verify_runs(args: argparse.Namespace, fit: dict, rows: list[dict]) -> list[str]:
    """GPU runs at the next size (the smallest preset outside the fit): lr*/2, lr*, 2 lr* over the seeds,
    at the fit's own data, tokenizer, warmup, steps, sequence and batch, with their planned cost (6 N tokens
    FLOPs at MFU 0.3)."""
    lines = []
    outside = [r for r in rows if not r["inside"]]
    if not outside:
        return lines
    nxt = min(outside, key=lambda r: r["width"] * r["depth"])
    p = PRESETS[nxt["preset"]]
    n = ModelConfig(vocab_size=32000, norm_position="post", num_layers=p["num_layers"],
                    hidden_size=p["hidden_size"], ffn_hidden_size=p["ffn_hidden_size"],
                    num_attention_heads=p["num_attention_heads"]).num_parameters()
    tokens = args.iters * args.batch * args.seq_length
    secs = 6 * n * tokens / (H100_BF16_TFLOPS * 1e12 * PLANNED_MFU)
    variant = parse_variant(args.variant)
    flags = "".join(f"{f} " for f in variant.flags)
    for factor in (0.5, 1.0, 2.0):
        lr = nxt["lr_star"] * factor
        for s in args.seeds:
            lines.append(
                f"python -m megapost.pretrain --preset {nxt['preset']} --norm-position {variant.placement} "
                f"--data-path {args.data_path} --tokenizer-model {args.tokenizer_model} "
                f"{flags}--lr {lr:.3g} --min-lr {lr / 10:.3g} --lr-warmup-iters {args.warmup} "
                f"--train-iters {args.iters} --seq-length {args.seq_length} "
                f"--global-batch-size {args.batch} --micro-batch-size {args.batch} --seed {s} "
                f"--init-variance paper --plugins collapse_metrics --collapse-interval {args.interval}  "
                f"# predicted lr* {nxt['lr_star']:.3g} x {factor:g}; ~{secs:.2g} GPU-s of compute on one "
                f"H100 (6 N D at MFU {PLANNED_MFU}; plus start-up)")
    lines.append(f"# {len(lines)} runs at {nxt['preset']} ({nxt['label']}): ~{len(lines) * secs:.2g} GPU-s "
                 "of compute in all; start-up (model build, DeepSpeed init) dominates at these lengths")
    return lines


def plot(path: Path, points: list[Bracket], fit: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    panels = ((axes[0], "width", "depth", "width d"), (axes[1], "depth", "width", "depth L"))
    for ax, key, other, label in panels:
        for o in sorted({getattr(b, other) for b in points}):
            sel = sorted((b for b in points if getattr(b, other) == o and b.status == "open"),
                         key=lambda b: getattr(b, key))
            if not sel:
                continue
            x = [getattr(b, key) for b in sel]
            y = [b.estimate for b in sel]
            err = [[b.estimate - b.lo for b in sel], [b.hi - b.estimate for b in sel]]
            line = ax.errorbar(x, y, yerr=err, marker="o", ls="", capsize=3, label=f"{other} {o}")
            grid = [min(x) * 0.8, max(x) * 1.25]
            fx = [predict(fit, g, o)["lr_star"] if key == "width" else predict(fit, o, g)["lr_star"]
                  for g in grid]
            ax.plot(grid, fx, color=line[0].get_color(), lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("lr* (P(collapse) = 0.5)")
        ax.legend(fontsize=7)
    b, c = fit["b_width"], fit["c_depth"]
    fig.suptitle(f"lr* = a d^b L^c: b = {b if b is None else round(b, 2)}, "
                 f"c = {c if c is None else round(c, 2)} (bars: bisection brackets)", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def report(args: argparse.Namespace, points: list[Bracket]) -> dict:
    out = Path(args.out)
    fit = fit_power_law(points)
    rows = preset_rows(fit, [n for n in args.presets.split(",") if n])
    verify = verify_runs(args, fit, rows)
    data = {"placement": parse_variant(args.variant).placement, "variant": args.variant,
            "warmup": args.warmup, "collapse_grad_ratio": args.collapse_grad_ratio,
            "iters": args.iters, "seq_length": args.seq_length, "batch": args.batch,
            "tokens": args.iters * args.batch * args.seq_length, "seeds": args.seeds,
            "points": [b.as_dict() for b in points], "fit": fit, "presets": rows, "verify": verify}
    atomic_write_text(out / "boundary.json", json.dumps(data, indent=1))
    atomic_write_text(out / "verify.sh", "#!/usr/bin/env bash\n" + "\n".join(verify) + "\n")
    plot(out / "boundary.png", points, fit)
    print(f"the planner's law: megapost-law boundary {out / 'boundary.json'}")
    print("| width | depth | lr* | bracket | probes (lr: collapsed/seeds) |\n|---|---|---|---|---|")
    for b in points:
        est = f"{b.estimate:.3g}" if b.status == "open" else b.status
        probes = ", ".join(f"{p['lr']:.3g}: {p['k']}/{p['n']}" for p in b.probes)
        print(f"| {b.width} | {b.depth} | {est} | [{b.lo:.3g}, {b.hi:.3g}] | {probes} |")
    print(f"fit: b (width) = {fit['b_width']} {fit['b_interval']}, c (depth) = {fit['c_depth']} "
          f"{fit['c_interval']}, {fit['points']} points, {fit['dof']} dof")
    for r in rows:
        print(f"{r['preset']:12s} {r['width']}x{r['depth']}: lr* {r['lr_star']:.3g} [{r['interval'][0]:.3g}, "
              f"{r['interval'][1]:.3g}] ({r['label']}; preset lr {r['preset_lr']:g})")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    parse_variant(args.variant)
    state = Path(args.out) / "brackets.json"
    if args.plot_only:
        points = [Bracket(**{k: v for k, v in b.items() if k != "estimate"})
                  for b in json.loads(state.read_text(encoding="utf-8"))]
    else:
        vocab = args.vocab = SentencePieceTokenizer(args.tokenizer_model).vocab_size
        cache = Path(os.path.dirname(os.path.abspath(args.data_path))) / "index-cache"
        freq = train_split_frequency_loss(Corpus(args.data_path, args.split, str(cache)), args.seq_length,
                                          vocab).aggregated
        points = start_brackets(args)
        args.pool = make_pool(args.engine, args.jobs, args.nice)
        args.rows, args.rows_lock = {}, threading.Lock()
        start, rnd = time.monotonic(), 0
        try:
            while any(b.next_lrs() for b in points):  # ends (widening as needed), then the midpoints
                probe(args, points, freq)  # finished cells are read back, never re-run
                atomic_write_text(state, json.dumps([b.as_dict() for b in points], indent=1))
                rnd += 1
                took, left = time.monotonic() - start, max(b.rounds_left() for b in points)
                print(f"[boundary] round {rnd} done in {took:.0f} s; >= {left} rounds left; ETA "
                      f"~{took / rnd * left / 60:.1f} min", flush=True)
        finally:
            args.pool.close()
    if len(points) == 1:  # one grid point (a factor study's setting): its bracket, no power-law fit
        b = points[0]
        print(f"[boundary] d={b.width} L={b.depth}: {b.status} [{b.lo:.4g}, {b.hi:.4g}] (one grid point: "
              "no fit; brackets.json and results.csv hold the probes)")
        return 0
    try:
        report(args, points)
    except ValueError as e:
        print(f"error: {e}; every other point ended below --lr-min or above --lr-max (see the table): "
              "widen them or change the grid", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
