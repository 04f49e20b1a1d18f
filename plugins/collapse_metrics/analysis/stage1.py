"""Stage I at initialisation (Figures 1 and 2): measured vs predicted one-step t_sim increments.

For each sublayer k of layer l the untrained model's probes give X_k^l, Y_k^l (and RMSNorm(Y_k^l) in
Post-Norm). Per sequence we record t_sim(X), t_sim(Y), t_sim(out) and ||X||_F^2, and form

    residual-add step  t_sim(Y) - t_sim(X)
    norm step          t_sim(RMSNorm(Y)) - t_sim(Y)            (Post-Norm only)
    predicted          Delta_attn((1 - alpha)^2 s, t_sim(X))   (Thm 3.2 / Cor 3.3)
                       Delta_FFN(xi, t_sim(X_2))               (Thm 3.4)

with s = n d^2 sigma_W^2 / ||X_1||_F^2 for Pre-Norm (measured norm) and s = d sigma_W^2 for Post-Norm
(the sublayer is homogeneous in X), xi = d d_ff sigma_W2^2 sigma_W3^2 (Pre-Norm: x n d / ||X_2||_F^2),
v = d sigma_W1^2. t_sim never materialises an n x n matrix: ||Pi X||_F^2 = ||sum_i x_i||^2 / n.

The closed forms are derived for the Post-Norm and Pre-Norm dataflows only (``theory_applies``). Every
other placement (sandwich, deepnorm, mix, hybrid, pre-scaled, dyt) is measured the same way, but its
``predicted`` and ``band_ratios`` are null (None) and the figures draw the measured curves alone
(docs/placements.md says why per placement). --qk-norm keeps the comparison: the surrogate replaces the
attention matrix by C_n whatever produces it (less accurate there: QK-norm logits have unit variance at init).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from collapse_metrics.analysis.theory import (
    InitVariances,
    amount_of_attention,
    ffn_delta,
    ffn_xi,
    intervention_delta,
    predicted_tsim_curve,
)
from collapse_metrics.similarity import sequence_partials, tsim_from_partials
from megapost.plugin_api import InitModels, atomic_path

ModelConfig = Any  # megapost's ModelConfig (a frozen dataclass: ``dataclasses.replace`` works on it)

SUBLAYERS = ("attn", "ffn")
FIELDS = ("t_x", "t_y", "t_out", "x_fro_sq", "y_fro_sq")
BANDS = 4  # layer bands for the measured/predicted summary (1-12, 13-24, ... at 48 layers)


def init_variances(cfg: ModelConfig, models: InitModels) -> InitVariances:
    """Entry variances exactly as megapost's init draws them (any scheme, any multiplier)."""
    var = {role: models.init_std(cfg, role) ** 2 for role in ("qkv", "wo", "w1", "w2", "w3", "embed")}
    return InitVariances(var["qkv"], var["qkv"], var["qkv"], var["wo"], var["w1"], var["w3"], var["w2"],
                         var["embed"])


def _stats(t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_sim [b], ||X||_F^2 [b]) of x [b, n, d] in fp32, or nans for None."""
    if t is None:
        return torch.tensor([float("nan")]), torch.tensor([float("nan")])
    partials = sequence_partials(t)
    return tsim_from_partials(partials), partials[:, -2]


class ProbeRecorder:
    """Probe listener: per (layer, sublayer) lists of per-sequence t_sim / ||.||_F^2 (no tensors kept)."""

    def __init__(self) -> None:
        self.embed: dict[str, list[float]] = {"t": [], "fro_sq": []}
        self.layers: dict[tuple[int, str], dict[str, list[float]]] = {}

    def __call__(self, name: tuple[Any, ...], **tensors: torch.Tensor | None) -> None:
        if name[0] == "embed":
            t, fro = _stats(tensors["x"])
            self.embed["t"] += t.tolist()
            self.embed["fro_sq"] += fro.tolist()
            return
        if name[0] != "layer":
            return
        rec = self.layers.setdefault((int(name[1]), str(name[2])), {f: [] for f in FIELDS})
        tx, fx = _stats(tensors["x"])
        ty, fy = _stats(tensors["y"])
        tout, _ = _stats(tensors.get("out"))
        for key, val in zip(FIELDS, (tx, ty, tout.expand_as(tx), fx, fy), strict=True):
            rec[key] += val.tolist()

    def arrays(self, num_layers: int) -> dict[str, Any]:
        """{"embed": {t, fro_sq: [S]}, "attn"/"ffn": {field: [S, L]}} as numpy float64."""
        out: dict[str, Any] = {"embed": {k: np.asarray(v, dtype=np.float64) for k, v in self.embed.items()}}
        for sub in SUBLAYERS:
            out[sub] = {f: np.stack([np.asarray(self.layers[(layer, sub)][f], dtype=np.float64)
                                     for layer in range(1, num_layers + 1)], axis=1) for f in FIELDS}
        return out


def measure(cfg: ModelConfig, tokens: torch.Tensor, dtype: torch.dtype = torch.float32, *,
            models: InitModels) -> dict[str, Any]:
    """Forward-only pass of the untrained model over ``tokens`` [S, n], one sequence at a time (the LM
    head is skipped); returns ProbeRecorder.arrays, the init variances and the wall time."""
    start = time.perf_counter()
    recorder = ProbeRecorder()
    models.untrained_forward(cfg, tokens, dtype, recorder)
    out = recorder.arrays(cfg.num_layers)
    out["init_variances"] = init_variances(cfg, models)
    out["runtime_s"] = time.perf_counter() - start
    return out


THEORY_PLACEMENTS = ("post", "pre")


def theory_applies(cfg: ModelConfig) -> bool:
    """Whether the Stage-I closed forms (Thms 3.2, 3.4: derived for Post- and Pre-Norm) describe ``cfg``."""
    return cfg.norm_position in THEORY_PLACEMENTS


def _layer_mean(v: np.ndarray) -> np.ndarray:
    """Mean over sequences [S, L] -> [L], nan for a layer without values (no warning)."""
    ok = ~np.isnan(v)
    count = ok.sum(0)
    return np.where(count > 0, np.where(ok, v, 0.0).sum(0) / np.maximum(count, 1), np.nan)


def measured_increments(meas: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-sequence [S, L] residual-add steps t(Y) - t(X) and norm steps t(out) - t(Y) (nan in Pre-Norm)."""
    return {f"{sub}_{kind}": (meas[sub]["t_y"] - meas[sub]["t_x"] if kind == "resid"
                              else meas[sub]["t_out"] - meas[sub]["t_y"])
            for sub in SUBLAYERS for kind in ("resid", "norm")}


def predicted_increments(cfg: ModelConfig, meas: dict[str, Any],
                         num_nodes: int = 80) -> dict[str, np.ndarray]:
    """Theory deltas [S, L] at each sublayer's measured input t_sim (and measured ||X||_F^2 in Pre-Norm);
    Post- and Pre-Norm only (``theory_applies``)."""
    _require_theory(cfg)
    n, d, f = cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size
    var = meas["init_variances"]
    nd = float(n * d)
    pre = cfg.norm_position == "pre"
    x1 = meas["attn"]["x_fro_sq"] if pre else np.full_like(meas["attn"]["t_x"], nd)
    x2 = meas["ffn"]["x_fro_sq"] if pre else np.full_like(meas["ffn"]["t_x"], nd)
    s = np.asarray(amount_of_attention(n, d, var.sigma_w2(d), x1))
    xi = ffn_xi(d, f, var.sigma_w2_2, var.sigma_w3_2) * nd / x2
    return {
        "s": s,
        "xi": xi,
        "attn": np.asarray(intervention_delta(s, meas["attn"]["t_x"], n, cfg.prefix_alpha)),
        "ffn": np.asarray(ffn_delta(xi, meas["ffn"]["t_x"], n, d * var.sigma_w1_2, num_nodes)),
    }


def iterated_curve(cfg: ModelConfig, meas: dict[str, Any]) -> dict[str, list[float]]:
    """predicted_tsim_curve from the embeddings' mean t_sim (Pre-Norm: measured mean ||X_k^l||_F^2)."""
    _require_theory(cfg)
    pre = cfg.norm_position == "pre"
    curve = predicted_tsim_curve(
        float(meas["embed"]["t"].mean()), cfg.num_layers, cfg.seq_length, cfg.hidden_size,
        cfg.ffn_hidden_size, meas["init_variances"], cfg.norm_position,
        x_fro_sq_per_layer=meas["attn"]["x_fro_sq"].mean(0) if pre else None,
        x2_fro_sq_per_layer=meas["ffn"]["x_fro_sq"].mean(0) if pre else None,
        embed_fro_sq=float(meas["embed"]["fro_sq"].mean()), alpha=cfg.prefix_alpha,
    )
    return {k: getattr(curve, k).tolist() for k in ("t_attn", "delta_attn", "t_ffn", "delta_ffn", "s", "xi",
                                                     "t_out")}


def _require_theory(cfg: ModelConfig) -> None:
    if not theory_applies(cfg):
        raise ValueError(f"the Stage-I closed forms are for --norm-position "
                         f"{' or '.join(THEORY_PLACEMENTS)}, not {cfg.norm_position} (measure() it and leave "
                         "the prediction null)")


def band_ratios(measured: np.ndarray, predicted: np.ndarray, bands: int = BANDS) -> list[dict[str, Any]]:
    """sum(measured) / sum(predicted) over consecutive layer bands (1-based inclusive layer ranges)."""
    out = []
    for idx in np.array_split(np.arange(len(measured)), bands):
        if not len(idx):
            continue
        m, p = float(np.sum(measured[idx])), float(np.sum(predicted[idx]))
        out.append({"layers": [int(idx[0]) + 1, int(idx[-1]) + 1], "measured": m, "predicted": p,
                    "ratio": m / p if p else float("nan")})
    return out


def analyse(cfg: ModelConfig, meas: dict[str, Any]) -> dict[str, Any]:
    """Every number of one (placement, multiplier, alpha) run: per-sequence arrays and their means;
    ``predicted`` and ``band_ratios`` are None where the theory does not apply (``theory_applies``)."""
    inc = measured_increments(meas)
    mean = {k: _layer_mean(v) for k, v in inc.items()}
    if not theory_applies(cfg):
        predicted, bands = None, None
    else:
        pred = predicted_increments(cfg, meas)
        predicted = {
            "s": pred["s"].tolist(),
            "xi": pred["xi"].tolist(),
            "per_sequence": {"attn": pred["attn"].tolist(), "ffn": pred["ffn"].tolist()},
            "mean": {"attn": pred["attn"].mean(0).tolist(), "ffn": pred["ffn"].mean(0).tolist()},
            "iterated": iterated_curve(cfg, meas),
        }
        bands = {sub: band_ratios(mean[f"{sub}_resid"], pred[sub].mean(0)) for sub in SUBLAYERS}
    return {
        "multiplier": cfg.sublayer_init_multiplier,
        "prefix_alpha": cfg.prefix_alpha,
        "runtime_s": meas["runtime_s"],
        "measured": {
            "embed_t_sim": meas["embed"]["t"].tolist(),
            "embed_fro_sq": meas["embed"]["fro_sq"].tolist(),
            **{sub: {f: meas[sub][f].tolist() for f in FIELDS} for sub in SUBLAYERS},
            "per_sequence": {k: v.tolist() for k, v in inc.items()},
            "mean": {k: v.tolist() for k, v in mean.items()},
            "total_attn_resid": float(np.sum(mean["attn_resid"])),
        },
        "predicted": predicted,
        "band_ratios": bands,
    }


def run_placement(base: ModelConfig, tokens: torch.Tensor, multipliers: Sequence[float],
                  alphas: Sequence[float] = (), dtype: torch.dtype = torch.float32,
                  log: Any = print, *, models: InitModels) -> dict[str, Any]:
    """The multiplier sweep (alpha = base.prefix_alpha) and, if ``alphas``, the prefix-alpha sweep
    (multiplier 1) for one norm placement."""
    done: dict[tuple[float, float], dict[str, Any]] = {}

    def one(**changes: float) -> dict[str, Any]:
        cfg = dataclasses.replace(base, **changes)
        key = (cfg.sublayer_init_multiplier, cfg.prefix_alpha)
        if key in done:
            return done[key]
        res = done[key] = analyse(cfg, measure(cfg, tokens, dtype, models=models))
        log(f"{cfg.norm_position}-norm multiplier {cfg.sublayer_init_multiplier:g} alpha "
            f"{cfg.prefix_alpha:g}: {res['runtime_s']:.1f} s, sum of attention increments "
            f"{res['measured']['total_attn_resid']:.4f}")
        return res

    out: dict[str, Any] = {
        "config": dataclasses.asdict(base),
        "num_sequences": int(tokens.shape[0]),
        "dtype": str(dtype).removeprefix("torch."),
        "runs": [one(sublayer_init_multiplier=float(m)) for m in multipliers],
    }
    if alphas:
        sweep = [one(sublayer_init_multiplier=1.0, prefix_alpha=float(a)) for a in alphas]
        out["prefix_alpha_sweep"] = sweep
        out["prefix_alpha_removed"] = removed_share(sweep)
    return out


def removed_share(sweep: Sequence[dict[str, Any]]) -> dict[str, float]:
    """1 - sum_l Delta_attn(alpha) / sum_l Delta_attn(alpha=0) for each alpha of the sweep."""
    by_alpha = {r["prefix_alpha"]: r["measured"]["total_attn_resid"] for r in sweep}
    if 0.0 not in by_alpha:
        return {}
    base = by_alpha[0.0]
    return {f"{a:g}": 1.0 - v / base for a, v in by_alpha.items()}


def _jsonable(obj: Any) -> Any:
    """nan/inf -> None recursively (strict JSON), numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | os.PathLike[str], obj: dict[str, Any]) -> Path:
    """Strict JSON (nan as null) written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_jsonable(obj), allow_nan=False) + "\n", encoding="utf-8")
    return Path(path)
