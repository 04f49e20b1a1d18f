"""The trigger experiment (issue 40 item 5): when is a Post-Norm run's collapse decided, what separates
the replicas that collapse, and which intervention from there rescues them.

    python tools/trigger_experiment.py run --out runs/trigger --data-path DATA/news2048_text_document \\
        --tokenizer-model DATA/bpe2048.model --lr 0.019 --seed 3 --snapshots 500,700,850,950,1000 \\
        --replicas 12 --end-step 1300 --intervene-at 850
    python tools/trigger_experiment.py report runs/trigger [--keep study/results/trigger]

``run`` trains one base run (64 x 4 Post-Norm by default: E1's setting, 256 tokens/step, warmup 500,
constant lr) through the real trainer with ``--plugins collapse_metrics``, takes in-memory rollback
snapshots at ``--snapshots`` and replays ``--replicas`` continuations from each, which differ only in
their data window after the snapshot (replica r: the base's data position + r * ``--data-offset``
samples; replica 0 is the base run), each to ``--end-step`` (a confirmed collapse ends it sooner);
then the interventions of ``--interventions`` from each ``--intervene-at`` snapshot over the same
replicas (paired). One process (``tools/trigger_runner.py``); resumable: a rerun replays only the jobs
without a record in ``OUT/replicas.jsonl`` (the base run is retrained up to the last snapshot). The
outcome of a replica is ``megapost.study.events``' rule; the analysis ``megapost.study.trigger``.
``report`` writes ``summary.json`` and ``summary.md`` (and copies replicas.jsonl and setting.json to
``--keep``). Every run is niced (``--nice``) with one torch thread.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from megapost.config.errors import ConfigError
from megapost.study import trigger
from megapost.utils.atomic import atomic_write_text


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def names(text: str) -> tuple[str, ...]:
    from trigger_runner import INTERVENTIONS

    out = tuple(v for v in text.split(",") if v)
    bad = [v for v in out if v not in INTERVENTIONS[1:]]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown intervention {bad[0]!r}; choose from "
                                         f"{', '.join(INTERVENTIONS[1:])}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the base run and its replicas")
    r.add_argument("--out", required=True)
    r.add_argument("--data-path", required=True)
    r.add_argument("--tokenizer-model", required=True)
    r.add_argument("--lr", type=float, default=0.019)
    r.add_argument("--seed", type=int, default=3)
    r.add_argument("--hidden", type=int, default=64)
    r.add_argument("--depth", type=int, default=4)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--seq-length", type=int, default=32)
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--warmup", type=int, default=500)
    r.add_argument("--snapshots", type=ints, default=(500, 700, 850, 950, 1000))
    r.add_argument("--replicas", type=int, default=12, help="per snapshot, the base run included")
    r.add_argument("--end-step", type=int, default=1300)
    r.add_argument("--data-offset", type=int, default=4000, help="samples between two replicas' windows")
    r.add_argument("--intervene-at", type=ints, default=(), help="snapshot steps of the interventions")
    r.add_argument("--interventions", type=names, default=("wo_lr0.1", "eps1e-6", "freeze_gains"))
    r.add_argument("--skip-controls", action="store_true",
                   help="replay only the interventions (their controls: another folder of the same setting)")
    r.add_argument("--top-layers", type=int, default=2, help="the top layers whose W_O wo_lr0.1 slows")
    r.add_argument("--feature-lag", type=int, default=10, help="features this many steps after a snapshot")
    r.add_argument("--interval", type=int, default=5, help="--collapse-interval")
    r.add_argument("--train-iters", type=int, default=15000,
                   help="--train-iters of the run: sizes the data set the windows are drawn from")
    r.add_argument("--nice", type=int, default=15)
    r.add_argument("--no-flush-denormal", dest="flush_denormal", action="store_false")
    rep = sub.add_parser("report", help="summary.json / summary.md of a run folder")
    rep.add_argument("folder", nargs="+", help="run folders of one setting (merged; the first is written)")
    rep.add_argument("--keep", help="copy the records and the summary here (study/results/trigger)")
    return p


def check(args: argparse.Namespace) -> None:
    """One-line errors for a plan that cannot run as asked."""
    snaps = sorted(args.snapshots)
    if not snaps or snaps[0] < 1 or args.end_step <= snaps[-1] + args.feature_lag:
        raise ConfigError("--snapshots: need steps >= 1 with the last + --feature-lag before --end-step")
    if any(s % args.interval for s in snaps) or args.feature_lag % args.interval or args.feature_lag < 1:
        raise ConfigError(f"--snapshots and --feature-lag must be multiples of --interval {args.interval} "
                          "(measured steps)")
    if not set(args.intervene_at) <= set(snaps):
        raise ConfigError("--intervene-at: every step must be one of --snapshots")
    if args.replicas < 1 or not 1 <= args.top_layers <= args.depth:
        raise ConfigError("--replicas must be >= 1 and 1 <= --top-layers <= --depth")
    need = args.batch * args.end_step + (args.replicas - 1) * args.data_offset
    if need > args.batch * args.train_iters:
        raise ConfigError(f"--data-offset x --replicas reach sample {need}, past the {args.batch} x "
                          f"--train-iters {args.train_iters} samples of the run's data set")


def trainer_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """E1's run (tools/stability_sweep.py's flags) with a long --train-iters; the lr is constant after
    the warmup, so --train-iters only sizes the data set."""
    h = args.hidden
    return [
        "--norm-position", "post", "--num-layers", str(args.depth), "--hidden-size", str(h),
        "--ffn-hidden-size", str(3 * h), "--num-attention-heads", str(args.heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.batch),
        "--global-batch-size", str(args.batch), "--train-iters", str(args.train_iters),
        "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-warmup-iters", str(args.warmup),
        "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--init-variance", "paper", "--seed", str(args.seed), "--split", "969,30,1",
        "--data-path", args.data_path, "--tokenizer-model", args.tokenizer_model,
        "--tensorboard-dir", str(out / "run" / "tensorboard"), "--eval-interval", "0",
        "--log-interval", "100", "--plugins", "collapse_metrics", "--collapse-interval", str(args.interval),
        "--collapse-image-interval", "0", "--collapse-early-warning",
    ]


def setting(args: argparse.Namespace, out: Path) -> dict[str, object]:
    keys = ("lr", "seed", "hidden", "depth", "heads", "seq_length", "batch", "warmup", "snapshots",
            "replicas", "end_step", "data_offset", "intervene_at", "interventions", "top_layers",
            "feature_lag", "interval", "train_iters", "flush_denormal")
    return {"schema": trigger.SCHEMA + ".setting", "version": trigger.VERSION,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items() if k in keys},
            "data_path": args.data_path, "trainer_argv": trainer_argv(args, out),
            "differs_between_replicas": "the data window after the snapshot: replica r trains on the "
            "samples from the base run's position + r * data_offset on (replica 0 = the base run)"}


def run(args: argparse.Namespace) -> int:
    from trigger_runner import Job, Plan, run_plan

    check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = setting(args, out)
    prev = out / "setting.json"
    if prev.is_file():
        old = json.loads(prev.read_text(encoding="utf-8"))
        fixed = ("lr", "seed", "hidden", "depth", "warmup", "data_offset", "train_iters", "end_step")
        diff = [k for k in fixed if old.get(k) != wanted.get(k)]
        if diff:
            raise ConfigError(f"{prev}: this folder was run with other {', '.join(diff)}; use a new --out")
    atomic_write_text(prev, json.dumps(wanted, indent=1) + "\n")
    records = out / "replicas.jsonl"
    done_recs = trigger.read_records(records) if records.is_file() else []
    done = {Job(int(r["snapshot"]), int(r["replica"]), r["intervention"]) for r in done_recs}
    plan = Plan(tuple(sorted(args.snapshots)), args.replicas, args.end_step, args.data_offset,
                args.feature_lag, args.interval, args.top_layers, tuple(args.intervene_at),
                tuple(args.interventions), not args.skip_controls, done)
    base = {j.snapshot for j in done if j.replica == 0 and j.intervention == trigger.CONTROL}
    if plan.jobs() or not base >= set(plan.snapshots):
        if args.nice:
            os.nice(args.nice)
        import torch

        torch.set_num_threads(1)
        torch.set_flush_denormal(args.flush_denormal)
        run_plan(trainer_argv(args, out), plan, out, lambda s: s in base)
    return report([out], None)


def with_final_gap(folder: Path, records: list[dict[str, object]]) -> list[dict[str, object]]:
    """Records written before ``final_gap`` was recorded get it from their series file (the same
    trailing mean; a replica's file holds its own steps, the base's its whole run)."""
    out = []
    for rec in records:
        path = folder / "series" / f"{trigger.series_name(rec)}.csv"
        if "final_gap" not in rec and path.is_file():
            rows = list(csv.DictReader(path.open(encoding="utf-8")))
            losses = [float(r["loss"]) if r["loss"] else None for r in rows]
            rec = {**rec, "final_gap": trigger.final_gap(losses, float(rec["freq_loss"]))}
        out.append(rec)
    return out


def report(folders: Sequence[Path], keep: str | None) -> int:
    """The summary of the records of ``folders`` (merged: ``replicas_merged.jsonl``, ``summary.json``,
    ``summary.md`` in the first); ``keep``: the merged records as ``replicas.jsonl``, the summary, every
    folder's ``setting.json`` as ``setting_<folder>.json`` and every series file, copied there."""
    folder = folders[0]
    records, conflicts = trigger.merge([with_final_gap(f, trigger.read_records(f / "replicas.jsonl"))
                                        for f in folders])
    for line in conflicts:
        print(f"trigger_experiment: {line}", file=sys.stderr)
    merged = "".join(json.dumps(r) + "\n" for r in records)
    atomic_write_text(folder / "replicas_merged.jsonl", merged)
    summ = trigger.summary(records)
    atomic_write_text(folder / "summary.json", json.dumps(summ, indent=1) + "\n")
    text = trigger.markdown(summ)
    atomic_write_text(folder / "summary.md", text)
    print(text, end="")
    if keep:
        dest = Path(keep)
        dest.mkdir(parents=True, exist_ok=True)
        atomic_write_text(dest / "replicas.jsonl", merged)
        for name in ("summary.json", "summary.md"):
            shutil.copyfile(folder / name, dest / name)
        for f in folders:
            if (f / "setting.json").is_file():
                shutil.copyfile(f / "setting.json", dest / f"setting_{f.name}.json")
            if (f / "series").is_dir():
                shutil.copytree(f / "series", dest / "series", dirs_exist_ok=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return run(args)
        return report([Path(f) for f in args.folder], args.keep)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"trigger_experiment: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
