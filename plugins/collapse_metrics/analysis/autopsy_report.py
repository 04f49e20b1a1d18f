"""Reading ``autopsy.jsonl`` (``autopsy.py``) into scalar series, and where two runs' series part.

Each autopsy record becomes scalars: ``update_ratio/<layer>``, ``adam_v_mean/<layer>``,
``attn_entropy/layer<i>`` (mean over heads) and ``attn_entropy_min/layer<i>`` (the lowest head), the
norms, ``sharpness_precond`` and ``sharpness/eos`` (sharpness over Adam's edge-of-stability threshold).

Separation of a collapsing from a non-collapsing run, aligned on their event step: a quantity separates
at the first offset from which on the two runs' values differ by more than a factor ``ratio`` (or, for
entropies, which are already logs, by more than ``log(ratio)``) at every common offset up to the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

LOG_SCALE = ("attn_entropy",)


def load_autopsy(path: str | Path) -> dict[str, dict[int, float]]:
    """``{quantity: {step: value}}`` (later records of a step supersede earlier ones)."""
    series: dict[str, dict[int, float]] = {}

    def put(name: str, step: int, value: Any) -> None:
        if value is not None and isinstance(value, (int, float)) and math.isfinite(value):
            series.setdefault(name, {})[step] = float(value)

    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        s = int(r["step"])
        for layer, v in (r.get("update_ratio") or {}).items():
            put(f"update_ratio/{layer}", s, v)
        for layer, (mean, _mx) in (r.get("adam_v") or {}).items():
            put(f"adam_v_mean/{layer}", s, mean)
        for i, heads in enumerate(r.get("attn_entropy") or [], start=1):
            put(f"attn_entropy/layer{i}", s, sum(heads) / len(heads))
            put(f"attn_entropy_min/layer{i}", s, min(heads))
        for k in ("logit_norm", "xh_norm", "head_weight_norm", "sharpness_precond", "lr"):
            put(k, s, r.get(k))
        if r.get("sharpness_precond") is not None and r.get("eos_threshold"):
            put("sharpness/eos", s, r["sharpness_precond"] / r["eos_threshold"])
        put("event_step", s, r.get("event_step"))
    return series


def separation(a: dict[int, float], b: dict[int, float], ref_a: int, ref_b: int, ratio: float = 1.5,
               log_scale: bool = False) -> int | None:
    """The first offset (step - ref) from which on ``a`` and ``b`` differ by more than ``ratio`` (or by
    more than log(ratio) in absolute value when ``log_scale``) at every common offset; None if never."""
    offs = sorted({s - ref_a for s in a} & {s - ref_b for s in b})

    def apart(o: int) -> bool:
        x, y = a[o + ref_a], b[o + ref_b]
        if log_scale:
            return abs(x - y) > math.log(ratio)
        if x <= 0 or y <= 0:
            return (x > 0) != (y > 0)
        return max(x / y, y / x) > ratio

    first = None
    for o in offs:
        if apart(o):
            first = o if first is None else first
        else:
            first = None
    return first


def rank_separations(collapsing: dict[str, dict[int, float]], other: dict[str, dict[int, float]],
                     ref_c: int, ref_o: int, ratio: float = 1.5) -> list[tuple[str, int | None]]:
    """Every shared quantity with its separation offset, earliest first (None last)."""
    rows = [(k, separation(collapsing[k], other[k], ref_c, ref_o, ratio, k.startswith(LOG_SCALE)))
            for k in sorted(set(collapsing) & set(other)) if k not in ("event_step", "lr")]
    return sorted(rows, key=lambda r: (r[1] is None, r[1] if r[1] is not None else 0))
