"""Sinks of the logging rank: TensorBoard scalars, a custom-scalars layout, a t_sim heatmap, JSONL.

TensorBoard tags. Up front (the ``collapse`` group of the Scalars page, a few cards):
    collapse/loss  collapse/freq_loss/{agg|seq|running|corpus}  collapse/t_sim/{embed|head}
    collapse/transition (1 on a flagged step)  collapse/collapsed (the state alarm: 1/0)
    collapse/grad_ratio (first/last-layer gradient ratio)
    collapse/summary/{q}/{min|median|max|deepest}  over layers, q in SUMMARIES (the deepest layer
      is the last measured one, where the collapse shows first)
Per-layer detail behind it (the ``collapse_layers`` group; l zero-padded to two digits, k in {attn, ffn}):
    collapse_layers/t_sim/L{l}/{k}/{x|y|out}     collapse_layers/rms_factor/L{l}/{k}/{mean|min|max}
    collapse_layers/resid_norm/L{l}/{k}  collapse_layers/alpha/L{l}/{k}  collapse_layers/c/L{l}/{k}
    collapse_layers/grad_norm/L{l}  (+ /attn, /ffn, /norms)
Layers and the loss curves are also written as runs of their own (overlay.py: ``layers/L{l}/``,
``loss/<curve>/``) so TensorBoard colours them apart. Alarm lines are also TensorBoard text
(``collapse/alerts``). Null values (e.g. t_sim/out under
Pre-Norm, alpha at step 0) are not written. Custom scalars: one chart per summary quantity
(min/median/max/deepest together) and, per layer group of ``LAYER_GROUP`` layers, one chart per
per-layer quantity (few enough series to tell apart).
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from typing import Any

import numpy as np

from megapost.plugin_api import atomic_write_text

from .overlay import Overlay
from .table import SUBLAYERS

JSONL_NAME = "collapse_metrics.jsonl"
# JSONL fields after "step": per (layer, sublayer) record, and the step's own record
LAYER_FIELDS = ("layer", "sublayer", "t_sim_x", "t_sim_y", "t_sim_out", "resid_norm", "rms_factor_mean",
                "rms_factor_min", "rms_factor_max", "alpha", "c", "grad_norm", "grad_norm_layer",
                "grad_norm_norms")
STEP_FIELDS = ("loss", "freq_loss_agg", "freq_loss_seq", "freq_loss_running", "freq_loss_corpus",
               "t_sim_embed", "t_sim_head", "transition", "grad_ratio", "collapsed", "early_warning")
LAYER_GROUP = 4
# summary name -> (field, sublayers it pools over; None = the layer's output, as in the heatmap)
SUMMARIES = {"t_sim_out": ("t_sim_out", None), "alpha": ("alpha", SUBLAYERS), "c": ("c", SUBLAYERS),
             "rms_factor": ("rms_factor_mean", SUBLAYERS), "resid_norm": ("resid_norm", SUBLAYERS),
             "grad_norm_layer": ("grad_norm_layer", SUBLAYERS[:1])}
STATS = ("min", "median", "max", "deepest")


def _step_of(line: str) -> int:
    """A JSONL record's step; a torn last line (a killed writer) counts as past any resume point."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def finite(value: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def layer_tags(rec: dict[str, Any]) -> dict[str, float | None]:
    """TensorBoard tag -> value for one (layer, sublayer) record."""
    base, k, p = f"L{rec['layer']:02d}", rec["sublayer"], "collapse_layers"
    tags = {f"{p}/t_sim/{base}/{k}/{t}": rec[f"t_sim_{t}"] for t in ("x", "y", "out")}
    tags |= {f"{p}/rms_factor/{base}/{k}/{s}": rec[f"rms_factor_{s}"] for s in ("mean", "min", "max")}
    tags |= {f"{p}/resid_norm/{base}/{k}": rec["resid_norm"], f"{p}/alpha/{base}/{k}": rec["alpha"],
             f"{p}/c/{base}/{k}": rec["c"], f"{p}/grad_norm/{base}/{k}": rec["grad_norm"]}
    if k == SUBLAYERS[0]:
        tags |= {f"{p}/grad_norm/{base}": rec["grad_norm_layer"],
                 f"{p}/grad_norm/{base}/norms": rec["grad_norm_norms"]}
    return tags


def layer_output(rec: dict[str, Any]) -> float | None:
    """t_sim of a layer's output: the normalised output (Post-Norm), else Y."""
    return rec["t_sim_out"] if rec["t_sim_out"] is not None else rec["t_sim_y"]


def summary_tags(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """collapse/summary/{q}/{min|median|max|deepest} over the measured layers (and sublayers)."""
    tags: dict[str, float | None] = {}
    deepest = max((r["layer"] for r in records), default=None)
    for name, (field, subs) in SUMMARIES.items():
        if subs is None:
            pairs = [(r["layer"], layer_output(r)) for r in records if r["sublayer"] == SUBLAYERS[-1]]
        else:
            pairs = [(r["layer"], r[field]) for r in records if r["sublayer"] in subs]
        values = [v for _, v in pairs if v is not None and math.isfinite(v)]
        last = [v for layer, v in pairs if layer == deepest and v is not None]
        stats = ((min(values), float(np.median(values)), max(values), last[-1] if last else None) if values
                 else (None,) * 4)
        tags |= {f"collapse/summary/{name}/{s}": v for s, v in zip(STATS, stats, strict=True)}
    return tags


def step_tags(rec: dict[str, Any]) -> dict[str, float | None]:
    tags = {f"collapse/freq_loss/{s}": rec[f"freq_loss_{s}"] for s in ("agg", "seq", "running", "corpus")}
    collapsed = rec["collapsed"]
    return tags | {"collapse/loss": rec["loss"], "collapse/t_sim/embed": rec["t_sim_embed"],
                   "collapse/t_sim/head": rec["t_sim_head"], "collapse/transition": float(rec["transition"]),
                   "collapse/grad_ratio": rec["grad_ratio"],
                   "collapse/collapsed": None if collapsed is None else float(collapsed),
                   "collapse/early_warning": None if rec.get("early_warning") is None
                   else float(rec["early_warning"])}


def layer_groups(layers: tuple[int, ...], size: int = LAYER_GROUP) -> list[tuple[int, ...]]:
    return [layers[i:i + size] for i in range(0, len(layers), size)]


def custom_scalars_layout(layers: tuple[int, ...]) -> dict[str, dict[str, list[Any]]]:
    """Category ``collapse``: loss vs frequency losses, t_sim embed/head, the alarm, one chart per
    summary quantity. One category per layer group with one chart per per-layer quantity."""
    top = {"loss vs frequency loss": [r"^collapse/loss$", r"^collapse/freq_loss/"],
           "t_sim embed/head": [r"^collapse/t_sim/(embed|head)$"],
           "alarm: collapsed, transition": [r"^collapse/(collapsed|transition)$"],
           "first/last-layer gradient ratio (log10)": [r"^collapse/log10_grad_ratio$"]}
    top |= {f"{name} over layers": [rf"^collapse/summary/{name}/"] for name in SUMMARIES}
    overlaid = {"loss vs frequency loss (a run per curve)": [r"^loss/vs_frequency_loss$"]}
    overlaid |= {f"{q} {k} (a run per layer)": [rf"^layer/{q}/{k}$"] for q in ("t_sim", "alpha")
                 for k in SUBLAYERS if q != "t_sim"}
    overlaid |= {f"t_sim {k} {t} (a run per layer)": [rf"^layer/t_sim/{k}/{t}$"] for k in SUBLAYERS
                 for t in ("x", "y", "out")}
    overlaid["log10 grad norm (a run per layer)"] = [r"^layer/log10_grad_norm$"]
    layout = {"overlaid": {name: ["Multiline", regexes] for name, regexes in overlaid.items()},
              "collapse": {name: ["Multiline", regexes] for name, regexes in top.items()}}
    for group in layer_groups(layers):
        ids = "|".join(f"{n:02d}" for n in group)
        charts: dict[str, list[str]] = {}
        for k in SUBLAYERS:
            for t in ("x", "y", "out"):
                charts[f"t_sim {k} {t}"] = [rf"^collapse_layers/t_sim/L({ids})/{k}/{t}$"]
            for s in ("mean", "min", "max"):
                charts[f"rms factor {k} {s}"] = [rf"^collapse_layers/rms_factor/L({ids})/{k}/{s}$"]
            for q in ("resid_norm", "alpha", "c", "grad_norm"):
                charts[f"{q} {k}"] = [rf"^collapse_layers/{q}/L({ids})/{k}$"]
        charts["grad_norm layer"] = [rf"^collapse_layers/grad_norm/L({ids})$"]
        charts["grad_norm norms"] = [rf"^collapse_layers/grad_norm/L({ids})/norms$"]
        name = f"layers {group[0]}-{group[-1]}" if len(group) > 1 else f"layer {group[0]}"
        layout[name] = {title: ["Multiline", regexes] for title, regexes in charts.items()}
    return layout


class TsimHeatmap:
    """t_sim of each layer's output (last sublayer: normalised output, else Y) against measured step."""

    def __init__(self, layers: tuple[int, ...], max_steps: int = 2000) -> None:
        self.layers = layers
        self.steps: deque[int] = deque(maxlen=max_steps)
        self.columns: deque[np.ndarray] = deque(maxlen=max_steps)

    def add(self, step: int, records: list[dict[str, Any]]) -> None:
        last = {r["layer"]: r for r in records if r["sublayer"] == SUBLAYERS[-1]}
        col = [layer_output(last[n]) for n in self.layers]
        self.steps.append(step)
        self.columns.append(np.array([np.nan if v is None else v for v in col], dtype=np.float64))

    def figure(self) -> Any:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        data = np.stack(list(self.columns), axis=1)  # [layers, steps]
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        im = ax.imshow(data, aspect="auto", origin="lower", vmin=0.0, vmax=1.0, cmap="viridis",
                       interpolation="nearest")
        ticks = np.linspace(0, len(self.steps) - 1, num=min(6, len(self.steps))).round().astype(int)
        ax.set_xticks(ticks, [str(self.steps[i]) for i in ticks])
        yt = np.linspace(0, len(self.layers) - 1, num=min(8, len(self.layers))).round().astype(int)
        ax.set_yticks(yt, [str(self.layers[i]) for i in yt])
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
        ax.set_title("t_sim of layer output")
        fig.colorbar(im, ax=ax, label="t_sim")
        fig.tight_layout()
        return fig


class Writers:
    """TensorBoard (``writer`` may be None) and the JSONL file (``directory`` may be None)."""

    def __init__(self, writer: Any, directory: str | None, layers: tuple[int, ...],
                 image_interval: int) -> None:
        self.writer = writer
        self.overlay = Overlay(writer, writer.log_dir) if writer is not None else None  # layers as runs
        self.layers = layers
        self.image_interval = image_interval
        self.heatmap = TsimHeatmap(layers)
        self.measured = 0
        self.layout_written = False
        self.jsonl = None
        self.jsonl_path = os.path.join(directory, JSONL_NAME) if directory else None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._open()

    def _open(self) -> None:
        self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115

    def drop_after(self, step: int) -> None:
        """Resuming at ``step``: rewrite the JSONL (atomically) without the records logged past it."""
        if self.jsonl is None:
            return
        self.jsonl.close()
        with open(self.jsonl_path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if line.strip() and _step_of(line) <= step]
        if len(kept) != len(lines):
            atomic_write_text(self.jsonl_path, "".join(kept))
        self._open()

    def write(self, step: int, layer_records: list[dict[str, Any]], step_record: dict[str, Any]) -> None:
        self.measured += 1
        self.heatmap.add(step, layer_records)
        if self.jsonl is not None:
            lines = [(r, LAYER_FIELDS) for r in layer_records] + [(step_record, STEP_FIELDS)]
            self.jsonl.write("".join(json.dumps({"step": step, **{f: finite(r[f]) for f in fields}}) + "\n"
                                     for r, fields in lines))
            self.jsonl.flush()
        if self.writer is None:
            return
        if not self.layout_written:
            self.writer.add_custom_scalars(custom_scalars_layout(self.layers))
            self.layout_written = True
        tags = step_tags(step_record) | summary_tags(layer_records)
        for rec in layer_records:
            tags |= layer_tags(rec)
        for tag, value in tags.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self.overlay.write(step, layer_records, step_record)
        if self.image_interval and self.measured % self.image_interval == 0:
            self.writer.add_figure("collapse/t_sim_heatmap", self.heatmap.figure(), step, close=True)

    def alert(self, step: int, line: str) -> None:
        """An alarm line as TensorBoard text (``collapse/alerts``)."""
        if self.writer is not None:
            self.writer.add_text("collapse/alerts", line, step)
            self.writer.flush()

    def guard(self, step: int, record: dict[str, Any]) -> None:
        """A guard rollback: a JSONL record ``{"step", "guard": {...}}`` and ``collapse/guard/*`` scalars."""
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "guard": record}) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            self.writer.add_scalar("collapse/guard/rollbacks", record["rollback"], step)
            self.writer.add_scalar("collapse/guard/to_step", record["to_step"], step)
            self.writer.add_scalar("collapse/guard/peak_lr", record["lr"], step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.flush()
            self.overlay.close()
