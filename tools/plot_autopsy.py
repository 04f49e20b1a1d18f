"""One figure (and a separation table) from ``--collapse-autopsy`` runs, aligned on the transition step.

    python tools/plot_autopsy.py --run collapsed=runs/autopsy/cells/post_L4_lr0.03_w200_s3/tensorboard \\
        --run plateau=runs/autopsy/cells/post_L4_lr0.03_w200_s1/tensorboard --out docs/figures/autopsy

Each ``--run NAME=DIR`` is a run's TensorBoard folder holding ``autopsy.jsonl`` and
``collapse_metrics.jsonl``. The x axis is step - reference: the transition step (outcome.py) of a run that
ends collapsed, else the step the autopsy's event fired (marked in the legend; ``--align event``: the event
for every run). Panels: loss - L,
t_sim(X^H), the deepest layer's residual norm, update/weight ratio (last layer), Adam sqrt(v_hat) (last
layer), attention entropy (last layer: mean and lowest head), preconditioned sharpness / Adam's
edge-of-stability threshold, logit norm. With a collapsed and a non-collapsed run it prints, per quantity,
the first offset from the event at which they stay apart (analysis/autopsy_report.py) and writes
<out>.png, <out>_separation.md.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from collapse_metrics.analysis.autopsy_report import load_autopsy, rank_separations
from collapse_metrics.analysis.outcome import read_run, summarize

from megapost.utils.atomic import atomic_path, atomic_write_text

PANELS = ("loss_gap", "t_sim_head", "resid_deep", "update_ratio/{last}", "adam_v_mean/{last}",
          "attn_entropy/{last}", "attn_entropy_min/{last}", "sharpness/eos", "logit_norm")


def load(spec: str, align: str = "transition") -> dict:
    name, eq, folder = spec.partition("=")
    d = Path(folder)
    if not eq or not (d / "autopsy.jsonl").is_file():
        raise SystemExit(f"error: --run {spec!r}: write NAME=DIR with DIR/autopsy.jsonl")
    rows = read_run(d / "collapse_metrics.jsonl")
    records = [json.loads(x) for x in (d / "collapse_metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    freq = next((r["freq_loss_corpus"] for r in records if r.get("freq_loss_corpus") is not None), None)
    if freq is None:
        raise SystemExit(f"error: --run {spec!r}: no freq_loss_corpus in collapse_metrics.jsonl "
                         "(the run had no --data-path)")
    out = summarize(rows, freq)
    auto = load_autopsy(d / "autopsy.jsonl")
    event = int(next(iter(auto["event_step"].values())))
    layers = sorted({k.split("/")[1] for k in auto if k.startswith("update_ratio/layer")},
                    key=lambda x: int(x[5:]))
    auto["loss_gap"] = {r.step: r.loss - freq for r in rows if r.loss is not None}
    auto["t_sim_head"] = {r.step: r.tsim_head for r in rows if r.tsim_head is not None}
    auto["resid_deep"] = {r.step: r.resid_deep for r in rows if r.resid_deep is not None}
    ref = out.transition_step if out.transition_step is not None and align == "transition" else event
    return {"name": name, "series": auto, "event": event, "ref": ref, "outcome": out, "last": layers[-1]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--out", required=True, help="path prefix: <out>.png, <out>_separation.md")
    p.add_argument("--ratio", type=float, default=1.5, help="separation: apart by more than this factor")
    p.add_argument("--align", choices=["transition", "event"], default="transition",
                   help="x = 0 at the transition (runs that collapse; the event otherwise) or at the event")
    args = p.parse_args(argv)
    runs = [load(s, args.align) for s in args.run]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(13, 9), dpi=72)
    for ax, panel in zip(axes.flat, PANELS, strict=True):
        for r in runs:
            key = panel.format(last=r["last"])
            s = r["series"].get(key, {})
            xs = sorted(s)
            ax.plot([x - r["ref"] for x in xs], [s[x] for x in xs], lw=1,
                    marker="." if len(xs) < 60 else None, label=f"{r['name']} ({r['outcome'].outcome}; x=0: "
                    f"{'event' if r['ref'] == r['event'] else 'transition'} {r['ref']})")
            ax.axvline(r["event"] - r["ref"], lw=0.6, ls=":", color=ax.lines[-1].get_color())
        ax.set_title(panel.format(last="last layer"), fontsize=9)
        if panel in ("update_ratio/{last}", "adam_v_mean/{last}", "logit_norm", "resid_deep"):
            ax.set_yscale("log")
        if panel == "sharpness/eos":
            ax.axhline(1.0, color="k", lw=0.6, ls="--")
        ax.set_xlabel("step - reference (dotted: autopsy event)", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    from PIL import Image

    with atomic_path(out.with_name(out.name + ".png")) as tmp:  # 64 colours: a small PNG for the docs
        Image.open(buf).convert("RGB").quantize(colors=64).save(tmp, format="PNG", optimize=True)
    coll = [r for r in runs if r["outcome"].outcome == "collapsed"]
    rest = [r for r in runs if r["outcome"].outcome != "collapsed"]
    if coll and rest:
        c, o = coll[0], rest[0]
        lines = [f"Separation of {c['name']} (collapsed, transition {c['outcome'].transition_step}) from "
                 f"{o['name']} ({o['outcome'].outcome}), aligned on the autopsy event (steps {c['event']} / "
                 f"{o['event']}); apart by > x{args.ratio:g} from the offset on:", "",
                 "| quantity | separates at event + | steps before the transition |", "|---|---|---|"]
        for key, off in rank_separations(c["series"], o["series"], c["event"], o["event"], args.ratio):
            lead = "" if off is None or c["outcome"].transition_step is None else \
                str(c["outcome"].transition_step - (c["event"] + off))
            lines.append(f"| {key} | {'never' if off is None else off} | {lead} |")
        text = "\n".join(lines) + "\n"
        atomic_write_text(out.with_name(out.name + "_separation.md"), text)
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
