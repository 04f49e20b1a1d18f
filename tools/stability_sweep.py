"""Stability sweep: short runs over lr x warmup x depth (x variant x seed) through the real trainer.

    python tools/stability_sweep.py --out runs/sweep --data-path data/news_text_document \\
        --tokenizer-model data/tokenizer.model --depths 2,6,12 --lrs 1e-2,3e-2,1e-1 --warmups 0,100 \\
        --variants post,pre,deepnorm,post+qk-norm,post+z-loss=1e-4

A variant is a placement (``--norm-position``) plus trainer flags joined by ``+``: ``post+qk-norm`` runs
``--norm-position post --qk-norm``, ``post+z-loss=1e-4`` runs ``--norm-position post --z-loss 1e-4``.

Every cell is one ``python -m megapost.pretrain`` subprocess with ``--plugins collapse_metrics``
(``--jobs`` at once, default: the available cores). A cell is finished when its ``outcome.json``
exists; a rerun skips finished cells (resumable). After each cell the results CSV
(``<out>/results.csv``) is rewritten atomically; at the end one phase-diagram PNG per depth
(``<out>/phase_L{depth}.png``: one lr x warmup panel per variant, colour = outcome, marker = transition
step) and the alarm's precision/recall against the ground truth (``collapse_metrics/analysis/outcome.py``) are
printed.
Flags after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from collapse_metrics.analysis.outcome import read_run, summarize
from collapse_metrics.analysis.probabilities import calibrate, candidate_rules, first_crossing
from collapse_metrics.analysis.probability_report import probability_figure, write_cells
from collapse_metrics.corpus import train_split_frequency_loss
from collapse_metrics.plugin import CollapseMetricsPlugin
from sweep_engine import add_run_flags, make_pool
from sweep_results import check_extra, check_same_setting, collapsed, settings, write_csv

from megapost.config.arguments import build_parser as trainer_parser
from megapost.config.errors import ConfigError
from megapost.data import SentencePieceTokenizer
from megapost.model.placements import PLACEMENTS
from megapost.study.events import from_series
from megapost.train.plugin_services import Corpus
from megapost.utils.atomic import atomic_write_text


@dataclass(frozen=True)
class Variant:
    """A placement plus trainer flags, e.g. ``post+z-loss=1e-4`` -> ``--norm-position post --z-loss 1e-4``."""

    name: str
    placement: str
    flags: tuple[str, ...]


@functools.cache
def _trainer_options() -> dict[str, argparse.Action]:
    return trainer_parser([CollapseMetricsPlugin])._option_string_actions


def parse_variant(text: str) -> Variant:
    """Checks the placement and every flag against the trainer's parser (one-line ConfigError)."""
    placement, *mods = text.split("+")
    if placement not in PLACEMENTS:
        raise ConfigError(f"--variants: {text!r} starts with {placement!r}, not a placement; "
                          f"choose from {', '.join(PLACEMENTS)}")
    options = _trainer_options()
    flags: list[str] = []
    for mod in mods:
        name, eq, value = mod.partition("=")
        flag = f"--{name}"
        action = options.get(flag)
        if action is None or flag in ("--norm-position", "--help"):
            raise ConfigError(f"--variants: {text!r}: {flag} is not a megapost.pretrain flag a variant can "
                              "set")
        if (action.nargs == 0) == bool(eq):
            raise ConfigError(f"--variants: {text!r}: {flag} " + (f"takes no value: write +{name}" if eq else
                                                                  f"takes a value: write +{name}=VALUE"))
        try:
            if eq and callable(action.type):
                action.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--variants: {text!r}: {value!r} is not a valid value for {flag}") from None
        flags += [flag, value] if eq else [flag]
    return Variant(text, placement, tuple(flags))


def variants(text: str) -> list[Variant]:
    return [parse_variant(v) for v in text.split(",") if v]


@dataclass(frozen=True)
class Cell:
    variant: str
    depth: int
    lr: float
    warmup: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}_L{self.depth}_lr{self.lr:g}_w{self.warmup}_s{self.seed}"


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="sweep folder (cells/, results.csv, phase_L*.png)")
    p.add_argument("--data-path", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--depths", type=ints, default=[2, 6, 12])
    p.add_argument("--lrs", type=floats, default=[1e-2, 3e-2, 1e-1])
    p.add_argument("--warmups", type=ints, default=[0, 100])
    p.add_argument("--variants", "--norms", type=variants, default="post,pre",
                   help="comma-separated placement[+flag[=value]]..., e.g. post,pre,post+z-loss=1e-4")
    p.add_argument("--seeds", type=ints, default=[1])
    p.add_argument("--iters", type=int, default=250)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--interval", type=int, default=2, help="--collapse-interval of every run")
    p.add_argument("--split", default="969,30,1")
    add_run_flags(p)
    p.add_argument("--plot-only", action="store_true", help="rewrite the CSV and figures from finished cells")
    return p


def cell_argv(args: argparse.Namespace, cell: Cell, run_dir: Path) -> list[str]:
    h, variant = args.hidden, parse_variant(cell.variant)
    return [
        "--norm-position", variant.placement, *variant.flags, "--num-layers", str(cell.depth),
        "--hidden-size", str(h), "--ffn-hidden-size", str(3 * h), "--num-attention-heads", str(args.heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.batch),
        "--global-batch-size", str(args.batch),
        "--train-iters", str(args.iters), "--lr", str(cell.lr), "--min-lr", str(cell.lr / 10),
        "--lr-warmup-iters", str(cell.warmup), "--lr-decay-style", args.decay_style, "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--init-variance", args.init_variance, "--seed", str(cell.seed),
        "--split", args.split,
        "--data-path", args.data_path, "--tokenizer-model", args.tokenizer_model,
        "--tensorboard-dir", str(run_dir / "tensorboard"), "--eval-interval", "0", "--log-interval", "50",
        "--plugins", "collapse_metrics", "--collapse-interval", str(args.interval),
        "--collapse-image-interval", "0", *args.extra,
    ]


def train(args: argparse.Namespace, argv: list[str], run_dir: Path) -> int:
    """One run through ``args.pool`` (--engine), its output in ``train.log``; retried when the rendezvous
    port was taken between its pick and its bind (parallel cells)."""
    jsonl = run_dir / "tensorboard" / "collapse_metrics.jsonl"
    for _attempt in range(3):
        jsonl.unlink(missing_ok=True)  # an interrupted attempt starts over
        rc = args.pool.run(argv, run_dir / "train.log", args.flush_denormal)
        if rc == 0 or "EADDRINUSE" not in (run_dir / "train.log").read_text(errors="replace"):
            break
    return rc


def run_cell(args: argparse.Namespace, cell: Cell, freq_loss: float) -> dict[str, object] | None:
    run_dir = Path(args.out) / "cells" / cell.name
    done = run_dir / "outcome.json"
    setting = settings(args, parse_variant(cell.variant), cell, args.vocab)
    if done.is_file():
        prev = json.loads(done.read_text(encoding="utf-8"))
        check_same_setting(done, prev, setting)
        return prev
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rc = train(args, cell_argv(args, cell, run_dir), run_dir)
    jsonl = run_dir / "tensorboard" / "collapse_metrics.jsonl"
    if rc != 0 or not jsonl.is_file():
        print(f"[sweep] {cell.name}: trainer exited with {rc}; see {run_dir / 'train.log'}", flush=True)
        return None
    rows = read_run(jsonl)
    outcome = summarize(rows, freq_loss)
    result = {**setting, **asdict(cell), **asdict(outcome), "final_loss": freq_loss + outcome.final_gap,
              "last_loss": rows[-1].loss, "freq_loss": freq_loss,
              "collapse_grad_ratio": args.collapse_grad_ratio,
              "seconds": round(time.monotonic() - start, 1), "engine": args.pool.engine,
              "flush_denormal": args.flush_denormal}
    result["collapsed"] = int(collapsed(result, args.collapse_grad_ratio))
    ev = from_series([r.step for r in rows], [r.loss for r in rows], [r.tsim_head for r in rows],
                     [r.ratio for r in rows], freq_loss)  # the three outcomes (megapost/study/events.py)
    result.update(event=ev.kind, event_step=ev.step, learned_step=ev.learned_step)
    atomic_write_text(done, json.dumps(result))
    print(f"[sweep] {cell.name}: {result['outcome']} transition {result['transition_step']} alarm "
          f"{result['alarm_step']} best {result['best_gap']:+.2f} final {result['final_gap']:+.2f} "
          f"({result['seconds']:.0f} s)", flush=True)
    return result


def alarm_scores(results: list[dict[str, object]]) -> dict[str, object]:
    """Recall over Post-Norm runs (placement post, any flags) ending collapsed (a Pre-Norm run ending on
    the plateau with live gradients is not the collapsed state); false alarms over runs ending trained."""
    collapsed = [r for r in results if r["outcome"] == "collapsed" and r["placement"] == "post"]
    trained = [r for r in results if r["outcome"] == "trained"]
    flagged = [r for r in results if r["alarm_step"] is not None]
    hits = [r for r in collapsed if r["alarm_step"] is not None]
    lags = [r["alarm_step"] - r["transition_step"] for r in hits]
    false = [r for r in trained if r["alarm_step"] is not None]
    return {"collapsed": len(collapsed), "flagged": len(flagged), "recall": len(hits) / len(collapsed)
            if collapsed else math.nan, "trained": len(trained), "trained_flagged": len(false),
            "precision": len([r for r in flagged if r["outcome"] == "collapsed"]) / len(flagged)
            if flagged else math.nan, "alarm_minus_transition": lags, **warning_scores(results)}


def warning_scores(results: list[dict[str, object]]) -> dict[str, object]:
    """The early warning (Post-Norm runs): its lead before the transition on collapsed runs, and the
    runs that warned without collapsing within the run."""
    post = [r for r in results if r["placement"] == "post"]
    leads = [r["transition_step"] - r["warning_step"] for r in post
             if r["outcome"] == "collapsed" and r.get("warning_step") is not None]
    return {"warning_lead_before_transition": leads,
            "warned_not_collapsed": [f"{r['variant']}_L{r['depth']}_lr{r['lr']:g}_w{r['warmup']}_"
                                     f"{r['outcome']}" for r in post if r["outcome"] != "collapsed"
                                     and r.get("warning_step") is not None]}


def warning_calibration(out: Path, results: list[dict[str, object]]) -> list[dict[str, object]]:
    """Candidate early-warning rules replayed on every Post-Norm run's JSONL, scored against the outcome
    (``analysis/probabilities.calibrate``): residual-norm growth x F (the shipped rule is F = 4), a
    rise of t_sim(X^H) once the loss has been 0.5 below L, the loss climbing back above its running
    minimum, and the first/last-layer gradient ratio falling below R
    (the alarm's test with a looser threshold)."""
    runs = []
    for r in results:
        if r["placement"] != "post":
            continue
        cell = Cell(str(r["variant"]), int(r["depth"]), float(r["lr"]), int(r["warmup"]), int(r["seed"]))
        rows = read_run(out / "cells" / cell.name / "tensorboard" / "collapse_metrics.jsonl")
        runs.append({**r, "resid": [(x.step, x.resid_deep) for x in rows],
                     "tsim": [(x.step, x.tsim_head) for x in rows], "loss": [(x.step, x.loss) for x in rows],
                     "inv_ratio": [(x.step, 1 / x.ratio if x.ratio else None) for x in rows],
                     "learned": first_crossing([(x.step, None if x.loss is None else -x.loss) for x in rows],
                                               0.5 - float(r["freq_loss"])) or 10**9})
    rules = candidate_rules()
    return calibrate(runs, rules) if runs else []


class Progress:
    """``[sweep] k/N cells (m run here, mean s per run) ETA ...`` after each cell."""

    def __init__(self, total: int, jobs: int) -> None:
        self.total, self.jobs, self.done, self.ran, self.spent = total, max(1, jobs), 0, 0, 0.0

    def update(self, result: dict[str, object] | None, fresh: bool) -> str:
        self.done += 1
        if fresh and result is not None:
            self.ran, self.spent = self.ran + 1, self.spent + float(result["seconds"])
        left = self.total - self.done
        eta = (f"ETA {left * self.spent / self.ran / min(self.jobs, max(left, 1)) / 60:.1f} min"
               if self.ran else "ETA ?")
        return (f"[sweep] progress {self.done}/{self.total} cells ({self.ran} run now, "
                f"{self.spent / max(self.ran, 1):.0f} s each); {eta}")


OUTCOME_COLOURS = {"collapsed": "tab:red", "trained": "tab:green", "plateau": "tab:orange"}


LABELS = {"post": "Post-Norm", "pre": "Pre-Norm"}


def phase_diagram(path: Path, depth: int, results: list[dict[str, object]], freq_loss: float) -> None:
    """One lr x warmup panel per variant (in the order of ``results``), up to 5 panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(str(r["variant"]) for r in results))
    cols = min(5, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + 0.4), dpi=90, squeeze=False,
                             sharey=True)
    warmups = sorted({int(r["warmup"]) for r in results})
    lrs = sorted({float(r["lr"]) for r in results})
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        for r in (r for r in results if r["variant"] == name):
            y = warmups.index(int(r["warmup"]))
            marker = "X" if r["delayed"] else ("o" if r["transition_step"] is None else "v")
            ax.scatter(float(r["lr"]), y, s=240, c=OUTCOME_COLOURS[str(r["outcome"])], marker=marker,
                       edgecolors="k")
            label = (f"t={r['transition_step']}" if r["transition_step"] is not None
                     else f"{r['final_gap']:+.2f}")
            ax.annotate(label, (float(r["lr"]), y), textcoords="offset points", xytext=(0, 14), ha="center",
                        fontsize=8)
        ax.set_xscale("log")
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
        ax.minorticks_off()
        ax.set_xlim(lrs[0] / 1.6, lrs[-1] * 1.6)
        ax.set_yticks(range(len(warmups)), [str(w) for w in warmups])
        ax.set_ylim(-0.6, len(warmups) - 0.3)
        ax.set_xlabel("peak lr")
        ax.set_title(f"{LABELS.get(name, name)}, {depth} layers")
    for row in axes:
        row[0].set_ylabel("warmup steps")
    handles = [plt.Line2D([], [], ls="", marker="s", color=c, label=o) for o, c in OUTCOME_COLOURS.items()]
    handles += [plt.Line2D([], [], ls="", marker=m, color="grey", label=lab) for m, lab in
                (("v", "collapsed at step t"), ("X", "delayed collapse"), ("o", "no collapse (final gap)"))]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"stability phase diagram (loss gap vs frequency loss {freq_loss:.2f} nats)", fontsize=9)
    fig.tight_layout(rect=(0, 0.12 / rows, 1, 1 - 0.05 / rows))
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def report_probabilities(out: Path, depths: Sequence[int], done: list[dict[str, object]]) -> None:
    """Per-cell probabilities over the seeds (cells.{csv,md,json}, prob_L*.png) and the early-warning
    calibration (warning.json), printed."""
    cells = write_cells(out, done)
    for depth in depths:
        rows = [r for r in cells if r["depth"] == depth]
        if rows:
            probability_figure(out / f"prob_L{depth}.png", depth, rows)
    print((out / "cells.md").read_text(encoding="utf-8"), end="", flush=True)
    scored = warning_calibration(out, done)
    atomic_write_text(out / "warning.json", json.dumps(scored, indent=1))
    for s in scored:
        p, r = s["precision"], s["recall"]
        print(f"[sweep] warning {s['rule']}: precision {p['k']}/{p['n']} [{p['lo']:.2f}, {p['hi']:.2f}], "
              f"recall {r['k']}/{r['n']} [{r['lo']:.2f}, {r['hi']:.2f}], lead {s['lead_steps']}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    check_extra(extra)
    out = Path(args.out)
    vocab = args.vocab = SentencePieceTokenizer(args.tokenizer_model).vocab_size
    cache = Path(os.path.dirname(os.path.abspath(args.data_path))) / "index-cache"
    freq = train_split_frequency_loss(Corpus(args.data_path, args.split, str(cache)), args.seq_length,
                                      vocab).aggregated
    print(f"[sweep] frequency loss of the train split: {freq:.4f} nats", flush=True)
    cells = [Cell(v.name, d, lr, w, s) for d, lr, w, s, v in itertools.product(
        args.depths, args.lrs, args.warmups, args.seeds, args.variants)]
    placement = {v.name: v.placement for v in args.variants}
    results: dict[Cell, dict[str, object]] = {}

    def finish(cell: Cell, result: dict[str, object] | None) -> None:
        if result is not None:  # (outcome.json of older sweeps named the variant "norm")
            results[cell] = {**result, **asdict(cell), "placement": placement[cell.variant],
                             "freq_loss": freq}
            write_csv(out / "results.csv", [results[c] for c in cells if c in results])

    if args.plot_only:
        for c in cells:
            done = out / "cells" / c.name / "outcome.json"
            if done.is_file():
                jsonl = done.parent / "tensorboard" / "collapse_metrics.jsonl"
                prev = json.loads(done.read_text(encoding="utf-8"))
                redo = asdict(summarize(read_run(jsonl), freq))
                finish(c, {**asdict(c), **redo, "seconds": prev["seconds"]})
    else:
        progress = Progress(len(cells), args.jobs)
        before = {c for c in cells if (out / "cells" / c.name / "outcome.json").is_file()}
        args.pool = make_pool(args.engine, args.jobs, args.nice)
        try:
            with ThreadPoolExecutor(max(1, args.jobs)) as pool:
                futures = {pool.submit(run_cell, args, c, freq): c for c in cells}
                for fut in as_completed(futures):
                    finish(futures[fut], fut.result())
                    print(progress.update(results.get(futures[fut]), futures[fut] not in before), flush=True)
        finally:
            args.pool.close()
    done = [results[c] for c in cells if c in results]
    for depth in args.depths:
        rows = [r for r in done if r["depth"] == depth]
        if rows:
            phase_diagram(out / f"phase_L{depth}.png", depth, rows, freq)
    scores = alarm_scores(done)
    atomic_write_text(out / "alarm.json", json.dumps(scores))
    report_probabilities(out, args.depths, done)
    print(f"[sweep] {len(done)}/{len(cells)} cells; alarm {scores}", flush=True)
    return 0 if len(done) == len(cells) else 1


if __name__ == "__main__":
    sys.exit(main())
