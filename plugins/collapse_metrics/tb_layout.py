"""TensorBoard tags and Custom Scalars layout of the collapse metrics: one TensorBoard run per training run.

TensorBoard colours by run (one directory of event files), so every tag of a training run goes into its
own writer's directory and two runs (Post vs Pre) get two colours. What stays readable at 48-96 layers:
    collapse/loss  collapse/freq_loss/{agg|seq|running|corpus}  collapse/t_sim/{embed|head}
      (freq_loss/seq, the mean of each sequence's own label entropy, is Theorem 3.8's floor: the bound
      is per sequence; docs/collapse_metrics.md)
    collapse/grad_ratio  collapse/log10_grad_ratio (first/last-layer gradient ratio; it spans decades)
    collapse/depth/{q}/{min|mean|max}   across the measured layers (and sublayers), q in DEPTH
    collapse/alarm/{collapsed|transition|early_warning}_at_step   the step an alarm went on, written
      at every measured step while it is on: a flat line smoothing cannot ramp (the 0/1 flags stay in
      the JSONL)
    collapse_layers/<q>/L{ll}/...   per-layer detail for the key layers only (first, quartiles, last:
      ``key_layers``); every layer is in the JSONL and in the images (images.py)
Custom Scalars: every chart holds at most ``MAX_TAGS`` tags, named in its title, so two runs side by
side draw at most 6 lines (TensorBoard's palette has 7 colours; the chart lists its matches by name).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .table import SUBLAYERS

MAX_TAGS = 3  # tags per Custom Scalars chart: two runs side by side draw <= 6 lines
# depth quantity -> (field, sublayers it pools over; None = the layer's output, as in the images)
DEPTH = {"t_sim_out": ("t_sim_out", None), "alpha": ("alpha", SUBLAYERS), "c": ("c", SUBLAYERS),
         "rms_factor": ("rms_factor_mean", SUBLAYERS), "resid_norm": ("resid_norm", SUBLAYERS),
         "grad_norm_layer": ("grad_norm_layer", SUBLAYERS[:1])}
STATS = ("min", "mean", "max")
ALARMS = ("collapsed", "transition", "early_warning")  # step-record fields that are 0/1 flags


def key_layers(layers: tuple[int, ...]) -> tuple[int, ...]:
    """First, quartiles and last of the measured layers: (1, 13, 25, 36, 48) of 48."""
    n = len(layers)
    return tuple(sorted({layers[round(q * (n - 1))] for q in (0.0, 0.25, 0.5, 0.75, 1.0)})) if n else ()


def layer_output(rec: dict[str, Any]) -> float | None:
    """t_sim of a layer's output: the normalised output (Post-Norm), else Y."""
    return rec["t_sim_out"] if rec["t_sim_out"] is not None else rec["t_sim_y"]


def log10(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    return math.log10(value) if ok else None


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


def depth_values(records: list[dict[str, Any]], name: str) -> list[float]:
    """The finite values of depth quantity ``name`` over the measured layers (and sublayers)."""
    field, subs = DEPTH[name]
    if subs is None:
        values = [layer_output(r) for r in records if r["sublayer"] == SUBLAYERS[-1]]
    else:
        values = [r[field] for r in records if r["sublayer"] in subs]
    return [v for v in values if v is not None and math.isfinite(v)]


def depth_tags(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """collapse/depth/{q}/{min|mean|max} across the measured layers."""
    tags: dict[str, float | None] = {}
    for name in DEPTH:
        values = depth_values(records, name)
        stats = (min(values), float(np.mean(values)), max(values)) if values else (None,) * 3
        tags |= {f"collapse/depth/{name}/{s}": v for s, v in zip(STATS, stats, strict=True)}
    return tags


def step_tags(rec: dict[str, Any]) -> dict[str, float | None]:
    tags = {f"collapse/freq_loss/{s}": rec[f"freq_loss_{s}"] for s in ("agg", "seq", "running", "corpus")}
    return tags | {"collapse/loss": rec["loss"], "collapse/t_sim/embed": rec["t_sim_embed"],
                   "collapse/t_sim/head": rec["t_sim_head"], "collapse/grad_ratio": rec["grad_ratio"],
                   "collapse/log10_grad_ratio": log10(rec["grad_ratio"])}


class AlarmSteps:
    """``collapse/alarm/<flag>_at_step``: the step each 0/1 flag went on, repeated while it stays on."""

    def __init__(self) -> None:
        self.on_since: dict[str, int | None] = dict.fromkeys(ALARMS)

    def tags(self, step: int, rec: dict[str, Any]) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for flag in ALARMS:
            on = bool(rec.get(flag))
            since = self.on_since[flag]
            if flag == "transition":  # flagged on one step only: it stays marked from there
                since = step if on and since is None else since
            else:
                since = (since if since is not None else step) if on else None
            self.on_since[flag] = since
            out[f"collapse/alarm/{flag}_at_step"] = None if since is None else float(since)
        return out


def _charts(charts: dict[str, list[str]]) -> dict[str, list[Any]]:
    return {title: ["Multiline", regexes] for title, regexes in charts.items()}


Layout = dict[str, dict[str, list[Any]]]


def custom_scalars_layout(layers: tuple[int, ...], normalised_out: bool = True) -> Layout:
    """Category ``collapse`` (losses, t_sim at the ends, gradient ratio), ``depth`` (min/mean/max across the
    layers per quantity) and ``key layers`` (one chart per quantity and key layer, attn beside ffn).
    Each chart matches at most ``MAX_TAGS`` tags, and its title says which. ``normalised_out``: the
    placement has a normalised layer output (t_sim/out; not Pre-Norm), else its charts are left out."""
    top = {"lm loss, and the train split's frequency loss (flat)": [r"^collapse/(loss|freq_loss/corpus)$"],
           "frequency loss of the step's labels: agg, per sequence (seq: Theorem 3.8's floor)":
               [r"^collapse/freq_loss/(agg|seq)$"],
           "t_sim(X^H) at the head": [r"^collapse/t_sim/head$"],
           "t_sim of the embeddings": [r"^collapse/t_sim/embed$"],
           "log10 first/last-layer gradient ratio": [r"^collapse/log10_grad_ratio$"]}
    depth = {f"{name}: min, mean, max across layers": [rf"^collapse/depth/{name}/(min|mean|max)$"]
             for name in DEPTH}
    keyed: dict[str, list[str]] = {}
    for n in key_layers(layers):
        p, ll = "^collapse_layers", f"L{n:02d}"
        if normalised_out:
            keyed[f"{ll} t_sim out: attn, ffn"] = [rf"{p}/t_sim/{ll}/(attn|ffn)/out$"]
        keyed |= {f"{ll} t_sim y: attn, ffn": [rf"{p}/t_sim/{ll}/(attn|ffn)/y$"],
                  f"{ll} rms factor mean: attn, ffn": [rf"{p}/rms_factor/{ll}/(attn|ffn)/mean$"],
                  f"{ll} grad norm of the layer": [rf"{p}/grad_norm/{ll}$"]}
        keyed |= {f"{ll} {q}: attn, ffn": [rf"{p}/{q}/{ll}/(attn|ffn)$"]
                  for q in ("alpha", "c", "resid_norm")}
    return {"collapse": _charts(top), "depth": _charts(depth), "key layers": _charts(keyed)}
