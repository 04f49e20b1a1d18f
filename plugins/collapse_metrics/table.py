"""One flat fp64 buffer per measured step holding every partial sum, and the metrics derived from it.

All partial statistics of a step live in named views of a single tensor, so the cross-rank
reduction is two collectives on it (``reduce.py``): the summed parts first, then the max parts
(``rms_ext``: maxima, and minima stored negated) at the end (``StatsBuffer.max_start``). Rows of the
per-layer parts follow the selected layers.

Per (layer, sublayer) sums, ``SUB`` columns (t_sim sums are over sequences, norms over tokens):
    tsim_x, tsim_y, tsim_out   sum of per-sequence t_sim of X_k, Y_k, RMSNorm(Y_k)
    n_x, n_y, n_out            number of sequences in each sum
    resid, rms, n_tok, n_rms   sum_i ||y_i||, sum_i sqrt(d)/||u_i|| (u = the residual-stream RMSNorm's
                               input), tokens in each sum (n_rms = 0 where the sublayer has no such
                               RMSNorm: hybrid's FFN, DyT; the RMS factor and c are then null)
    gx, gy, n_gx, n_gy         ||dL/dX_k||_F^2, ||dL/dY_k||_F^2 pooled over micro-batches, hook calls
Per layer ``GRAD``: squared parameter-gradient norms of attention, FFN, RMSNorm gains and the whole
layer, and ``count``, the number of gradient readings (0 on a forward-only step: norms are null).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUBLAYERS = ("attn", "ffn")
SUB = ("tsim_x", "tsim_y", "tsim_out", "n_x", "n_y", "n_out", "resid", "rms", "n_tok", "n_rms", "gx", "gy",
       "n_gx", "n_gy")
GRAD = ("attn", "ffn", "norms", "total", "count")
SITES = ("embed", "head")
COL = {name: i for i, name in enumerate(SUB)}
GCOL = {name: i for i, name in enumerate(GRAD)}


@dataclass(frozen=True)
class Part:
    shape: tuple[int, ...]
    op: str  # "sum" | "max"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_layers(spec: str | None, num_layers: int) -> tuple[int, ...]:
    """'1,2,47-48' -> (1, 2, 47, 48); empty/None -> all layers 1..num_layers."""
    if not spec or not spec.strip():
        return tuple(range(1, num_layers + 1))
    layers: set[int] = set()
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--collapse-layers: cannot read {item!r} (use e.g. '1,2,47-48')") from None
        if not 1 <= first <= last <= num_layers:
            raise ValueError(f"--collapse-layers: {item!r} is outside layers 1..{num_layers}")
        layers.update(range(first, last + 1))
    return tuple(sorted(layers))


class StatsBuffer:
    """Named views into one flat fp64 tensor (see module doc)."""

    def __init__(self, layers: Sequence[int], vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.layers = tuple(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.parts = {
            "sub": Part((n, len(SUBLAYERS), len(SUB)), "sum"),
            "grad": Part((n, len(GRAD)), "sum"),
            "site": Part((len(SITES), 2), "sum"),  # t_sim sum, sequences
            "labels": Part((vocab_size,), "sum"),  # label counts
            "label_seq": Part((2,), "sum"),  # sum of per-sequence label entropies, sequences
            "loss": Part((2,), "sum"),  # loss, 1 (logging rank only)
            "rms_ext": Part((n, len(SUBLAYERS), 2), "max"),  # max r, max(-r); the max parts come last
        }
        self.max_start = sum(p.numel for p in self.parts.values() if p.op == "sum")
        self.flat = torch.zeros(sum(p.numel for p in self.parts.values()), dtype=torch.float64, device=device)
        self.views: dict[str, torch.Tensor] = {}
        start = 0
        for name, part in self.parts.items():
            self.views[name] = self.flat[start:start + part.numel].view(part.shape)
            start += part.numel
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def reset(self) -> None:
        self.flat[:self.max_start].zero_()
        self.flat[self.max_start:].fill_(-math.inf)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of a reduced flat copy."""
        out, start = {}, 0
        for name, part in self.parts.items():
            out[name] = flat[start:start + part.numel].view(part.shape)
            start += part.numel
        return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _sqrt(v: float | None) -> float | None:
    return None if v is None else math.sqrt(max(v, 0.0))


def sublayer_record(sub: torch.Tensor, ext: torch.Tensor, grad: torch.Tensor, k: int
                    ) -> dict[str, float | None]:
    """Metrics of one (layer, sublayer) from its reduced rows (JSONL field names)."""
    s = dict(zip(SUB, sub.tolist(), strict=True))
    g = dict(zip(GRAD, grad.tolist(), strict=True))
    rms_mean = _ratio(s["rms"], s["n_rms"])
    alpha = None
    if s["n_gx"] > 0 and s["n_gy"] > 0:
        alpha = _sqrt(_ratio(s["gx"], s["gy"]))
    has_grad = g["count"] > 0
    return {
        "t_sim_x": _ratio(s["tsim_x"], s["n_x"]),
        "t_sim_y": _ratio(s["tsim_y"], s["n_y"]),
        "t_sim_out": _ratio(s["tsim_out"], s["n_out"]),
        "resid_norm": _ratio(s["resid"], s["n_tok"]),
        "rms_factor_mean": rms_mean,
        "rms_factor_min": -float(ext[k, 1]) if s["n_rms"] > 0 else None,
        "rms_factor_max": float(ext[k, 0]) if s["n_rms"] > 0 else None,
        "alpha": alpha,
        "c": alpha * rms_mean if alpha is not None and rms_mean is not None else None,
        "grad_norm": _sqrt(g[SUBLAYERS[k]]) if has_grad else None,
        "grad_norm_layer": _sqrt(g["total"]) if has_grad else None,
        "grad_norm_norms": _sqrt(g["norms"]) if has_grad else None,
    }


def layer_records(reduced: dict[str, torch.Tensor], layers: Sequence[int]) -> list[dict[str, float | None]]:
    """One record per (layer, sublayer), in layer order, with ``layer`` and ``sublayer`` keys."""
    records = []
    for i, layer in enumerate(layers):
        for k, sublayer in enumerate(SUBLAYERS):
            rec = sublayer_record(reduced["sub"][i, k], reduced["rms_ext"][i], reduced["grad"][i], k)
            records.append({"layer": layer, "sublayer": sublayer, **rec})
    return records


def site_tsim(reduced: dict[str, torch.Tensor], site: str) -> float | None:
    total, count = reduced["site"][SITES.index(site)].tolist()
    return _ratio(total, count)
