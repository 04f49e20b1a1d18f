"""Reading a run's ``collapse_metrics.jsonl`` (and its ``args.json``) into dense arrays, and the
collapse indicators of its last steps. numpy and json only: judging a sweep never imports matplotlib
(``figures`` draws from what this returns)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUBLAYERS = ("attn", "ffn")
PLACEMENT_LABELS = {"post": "Post-Norm", "pre": "Pre-Norm", "sandwich": "Sandwich (Peri-LN)",
                    "deepnorm": "DeepNorm", "mix": "Mix-LN", "hybrid": "HybridNorm",
                    "pre-scaled": "Pre-Norm + LayerNorm Scaling", "dyt": "DyT"}
ARGS_JSON = "args.json"  # written by megapost.pretrain beside collapse_metrics.jsonl


def placement_label(norm_position: str, qk_norm: bool = False) -> str:
    """Title text of a placement (``--norm-position``), with " + QK-norm" under ``--qk-norm``."""
    label = PLACEMENT_LABELS.get(norm_position, norm_position)
    return f"{label} + QK-norm" if qk_norm else label


LAYER_FIELDS = ("t_sim_x", "t_sim_y", "t_sim_out", "resid_norm", "rms_factor_mean", "rms_factor_min",
                "rms_factor_max", "alpha", "c", "grad_norm", "grad_norm_layer")
STEP_FIELDS = ("loss", "freq_loss_agg", "freq_loss_seq", "freq_loss_running", "freq_loss_corpus",
               "t_sim_embed", "t_sim_head", "transition", "grad_ratio", "collapsed")


def _num(v: Any) -> float:
    if v is None or isinstance(v, str):
        return math.nan
    return float(v)


@dataclass
class CollapseRun:
    """A run's metrics as dense arrays (nan where absent or null).

    ``layer[sub][field]`` is [len(layer_steps), num_layers]; ``step[field]`` is [len(steps)].
    """

    layer_steps: np.ndarray
    layers: np.ndarray
    layer: dict[str, dict[str, np.ndarray]]
    steps: np.ndarray
    step: dict[str, np.ndarray]
    run_args: dict[str, Any] | None = None  # the run's args.json beside the JSONL, when there is one

    @property
    def norm_label(self) -> str:
        """The placement from args.json; without one, "Post-Norm" when a normalised sublayer output was
        recorded (only post-style rules have one), else "Pre-Norm"."""
        if self.run_args and self.run_args.get("norm_position"):
            return placement_label(self.run_args["norm_position"], bool(self.run_args.get("qk_norm")))
        post = any(np.isfinite(t["t_sim_out"]).any() for t in self.layer.values())
        return "Post-Norm" if post else "Pre-Norm"

    @property
    def deepest_normalised(self) -> bool:
        """Whether the deepest layer's FFN normalised its residual sum after the add (t_sim_out recorded):
        the condition of the early warning (``early_warning.early_warning_applies``)."""
        table = self.layer.get("ffn")
        return bool(table is not None and len(self.layers) and np.isfinite(table["t_sim_out"][:, -1]).any())

    def window(self, margin: int) -> tuple[float, float]:
        """[first - margin, last + margin] around the steps flagged ``transition``; whole run if none."""
        flagged = self.steps[np.nan_to_num(self.step["transition"]) > 0]
        every = np.concatenate([self.steps, self.layer_steps])
        if not len(every):
            return (0.0, 0.0)
        if not len(flagged):
            return (float(every.min()), float(every.max()))
        return (float(flagged.min() - margin), float(flagged.max() + margin))

    def layer_grad(self) -> np.ndarray:
        """Per-layer parameter-gradient norm [steps, L]: ``grad_norm_layer`` where recorded, else
        sqrt(sum over sublayers of grad_norm^2)."""
        subs = [s for s in self.layer if s in SUBLAYERS]
        shape = (len(self.layer_steps), len(self.layers))
        if not subs:
            return np.full(shape, np.nan)
        sq = np.stack([np.square(self.layer[s]["grad_norm"]) for s in subs])
        from_subs = np.where(np.all(np.isnan(sq), axis=0), np.nan, np.sqrt(np.nansum(sq, axis=0)))
        whole = np.fmax.reduce(np.stack([self.layer[s]["grad_norm_layer"] for s in subs]), axis=0)
        return np.where(np.isnan(whole), from_subs, whole)


def summarize(run: CollapseRun, last: int = 5) -> dict[str, float | None]:
    """Collapse indicators averaged over the last ``last`` measured steps: loss, the frequency-loss
    references, last-layer output t_sim, head-input t_sim and layer-1 / layer-L gradient norm ratio."""
    def tail(values: np.ndarray) -> float | None:
        v = values[-last:]
        v = v[~np.isnan(v)]
        return float(v.mean()) if len(v) else None

    out = sub_table(run, "ffn", "t_sim_out")
    out = np.where(np.isnan(out), sub_table(run, "ffn", "t_sim_y"), out)
    grads = run.layer_grad()
    ratio = grads[:, 0] / grads[:, -1] if grads.size else np.full(0, np.nan)
    res = {f: tail(run.step[f]) for f in ("loss", "freq_loss_agg", "freq_loss_seq", "freq_loss_running",
                                          "t_sim_head")}
    res["t_sim_last_layer"] = tail(out[:, -1]) if out.size else None
    res["grad_ratio_first_last"] = tail(ratio)
    res["last_step"] = float(run.steps[-1]) if len(run.steps) else None
    return res


def load_collapse_jsonl(path: str | os.PathLike[str]) -> CollapseRun:
    """Parse ``collapse_metrics.jsonl``: records with ``layer`` go per (step, layer, sublayer), the rest
    per step. Unknown fields are ignored; nulls and missing fields become nan."""
    per_layer: dict[tuple[int, int, str], dict[str, Any]] = {}
    per_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("step") is None:
                continue
            if rec.get("layer") is not None:
                per_layer[(int(rec["step"]), int(rec["layer"]), str(rec.get("sublayer")))] = rec
            else:
                per_step.setdefault(int(rec["step"]), {}).update(rec)
    layer_steps = np.array(sorted({k[0] for k in per_layer}), dtype=np.int64)
    layers = np.array(sorted({k[1] for k in per_layer}), dtype=np.int64)
    si = {s: i for i, s in enumerate(layer_steps)}
    li = {v: i for i, v in enumerate(layers)}
    layer: dict[str, dict[str, np.ndarray]] = {}
    for (step, lay, sub), rec in per_layer.items():
        shape = (len(layer_steps), len(layers))
        table = layer.setdefault(sub, {f: np.full(shape, np.nan) for f in LAYER_FIELDS})
        for f in LAYER_FIELDS:
            table[f][si[step], li[lay]] = _num(rec.get(f))
    steps = np.array(sorted(per_step), dtype=np.int64)
    step = {f: np.array([_num(per_step[s].get(f)) for s in steps]) for f in STEP_FIELDS}
    return CollapseRun(layer_steps, layers, layer, steps, step, _run_args(Path(path).parent / ARGS_JSON))


def _run_args(path: Path) -> dict[str, Any] | None:
    """The run's model settings from args.json: its ``model`` section, or every flag by name in a run's
    args.json from before the sections (no ``format``); None when absent or unreadable (the label is then
    inferred)."""
    try:
        args = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(args, dict):
        return None
    return args.get("model") if isinstance(args.get("model"), dict) else args


def sub_table(run: CollapseRun, sub: str, field: str) -> np.ndarray:
    """``run.layer[sub][field]``, all nan when the run recorded no such sublayer."""
    table = run.layer.get(sub)
    return table[field] if table else np.full((len(run.layer_steps), len(run.layers)), np.nan)
