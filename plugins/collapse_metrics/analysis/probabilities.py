"""Outcomes as probabilities: per-cell aggregation over seeds, Wilson intervals, warning calibration.

A *cell* is every key of a run but its seed (variant, depth, lr, warmup, ...). Per cell:
P(collapsed) (every collapsed run), P(delayed collapse) (the collapsed runs that first learned, a
subset), P(plateau), P(trained) (collapsed + plateau + trained = 1), each with a Wilson score 95 %
interval; the transition steps; the final loss gap's mean, standard deviation and range.

Early-warning calibration: a rule *warns* on a run at its first firing step; a warning is a hit when
the run ends collapsed and the warning came at or before the transition. Precision = hits / warned
runs, recall = hits / collapsed runs (each with its Wilson interval), lead = transition - warning step.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
OUTCOMES = ("collapsed", "delayed", "plateau", "trained")


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n ((0, 1) when n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _prob(k: int, n: int) -> dict[str, float | int]:
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "p": k / n if n else math.nan, "lo": lo, "hi": hi}


def cell_key(run: dict[str, Any], keys: Sequence[str]) -> tuple:
    return tuple(run.get(k) for k in keys)


def _truthy(v: Any) -> bool:
    return v is True or str(v).lower() in ("true", "1")


def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    x = float(v)
    return x if math.isfinite(x) else None


def aggregate_cell(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The probabilities and distributions of one cell's runs (dicts with ``outcome``, ``delayed``,
    ``transition_step``, ``final_gap``, ``seed``)."""
    n = len(runs)
    outcome = [str(r["outcome"]) for r in runs]
    delayed = sum(1 for r, o in zip(runs, outcome, strict=True) if o == "collapsed" and _truthy(r["delayed"]))
    probs = {"collapsed": _prob(outcome.count("collapsed"), n), "delayed": _prob(delayed, n),
             "plateau": _prob(outcome.count("plateau"), n), "trained": _prob(outcome.count("trained"), n)}
    steps = sorted(int(s) for s in (_num(r.get("transition_step")) for r in runs) if s is not None)
    gaps = [g for g in (_num(r.get("final_gap")) for r in runs) if g is not None]
    return {"n": n, "seeds": sorted(int(r["seed"]) for r in runs if r.get("seed") not in (None, "")),
            **probs, "transition_steps": steps,
            "transition_median": statistics.median(steps) if steps else None,
            "final_gap_mean": statistics.fmean(gaps) if gaps else math.nan,
            "final_gap_std": statistics.stdev(gaps) if len(gaps) > 1 else math.nan,
            "final_gap_min": min(gaps, default=math.nan), "final_gap_max": max(gaps, default=math.nan)}


def aggregate(runs: Iterable[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """One row per cell (in first-seen order): the cell's keys plus ``aggregate_cell``."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault(cell_key(r, keys), []).append(r)
    return [{**dict(zip(keys, key, strict=True)), **aggregate_cell(rs)} for key, rs in cells.items()]


def fmt_prob(p: dict[str, float | int]) -> str:
    """``0.38 [0.14, 0.69] (3/8)``."""
    return f"{p['p']:.2f} [{p['lo']:.2f}, {p['hi']:.2f}] ({p['k']}/{p['n']})"


def markdown(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
    head = [*keys, "n", "P(collapsed)", "P(delayed)", "P(plateau)", "P(trained)", "transition steps",
            "final gap mean ± sd [min, max]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        steps = ", ".join(str(s) for s in r["transition_steps"]) or "–"
        gap = (f"{r['final_gap_mean']:+.2f} ± {r['final_gap_std']:.2f} "
               f"[{r['final_gap_min']:+.2f}, {r['final_gap_max']:+.2f}]")
        lines.append("| " + " | ".join([*(str(r[k]) for k in keys), str(r["n"]),
                                        *(fmt_prob(r[o]) for o in OUTCOMES), steps, gap]) + " |")
    return "\n".join(lines) + "\n"


# ---- early-warning calibration -------------------------------------------------------------------
def warning_scores(runs: Sequence[dict[str, Any]], warn_step: Callable[[dict[str, Any]], int | None]
                   ) -> dict[str, Any]:
    """Precision/recall (Wilson intervals) and lead times of one rule over runs with ``outcome`` and
    ``transition_step``; ``warn_step(run)`` is the rule's first firing step (None: never)."""
    collapsed = [r for r in runs if r["outcome"] == "collapsed"]
    warned = [(r, warn_step(r)) for r in runs]
    warned = [(r, s) for r, s in warned if s is not None]
    hits = [(r, s) for r, s in warned if r["outcome"] == "collapsed" and s <= int(r["transition_step"])]
    leads = sorted(int(r["transition_step"]) - s for r, s in hits)
    return {"runs": len(runs), "collapsed": len(collapsed), "warned": len(warned), "hits": len(hits),
            "precision": _prob(len(hits), len(warned)), "recall": _prob(len(hits), len(collapsed)),
            "lead_steps": leads, "lead_median": statistics.median(leads) if leads else None}


def first_crossing(series: Sequence[tuple[int, float | None]], threshold: float, after: int = 0
                   ) -> int | None:
    """First step > ``after`` whose value is >= threshold."""
    return next((s for s, v in series if s > after and v is not None and v >= threshold), None)


def first_growth(series: Sequence[tuple[int, float | None]], factor: float) -> int | None:
    """First step whose value reaches ``factor`` x the running minimum of the earlier values."""
    low = math.inf
    for s, v in series:
        if v is None or not math.isfinite(v):
            continue
        if v >= factor * low:
            return s
        low = min(low, v)
    return None


def calibrate(runs: Sequence[dict[str, Any]], rules: dict[str, Callable[[dict[str, Any]], int | None]]
              ) -> list[dict[str, Any]]:
    """``warning_scores`` per named rule, best F1 (point estimates) first."""
    def f1(s: dict[str, Any]) -> float:
        p, r = s["precision"]["p"], s["recall"]["p"]
        return 0.0 if not (p + r) or math.isnan(p) or math.isnan(r) else 2 * p * r / (p + r)

    scored = [{"rule": name, **warning_scores(runs, fn)} for name, fn in rules.items()]
    for s in scored:
        s["f1"] = f1(s)
    return sorted(scored, key=lambda s: -s["f1"])


def first_rise(series: Sequence[tuple[int, float | None]], level: float, below: float) -> int | None:
    """First step whose value is >= ``level`` after an earlier value was <= ``below`` (a re-rise)."""
    armed = False
    for s, v in series:
        if v is None or not math.isfinite(v):
            continue
        if armed and v >= level:
            return s
        armed = armed or v <= below
    return None


def first_above_min(series: Sequence[tuple[int, float | None]], delta: float, window: int = 5) -> int | None:
    """First step whose trailing ``window``-mean is >= ``delta`` above the running minimum of the earlier
    trailing means (the loss climbing back)."""
    vals = [(s, v) for s, v in series if v is not None and math.isfinite(v)]
    low = math.inf
    for i, (s, _) in enumerate(vals):
        chunk = [v for _, v in vals[max(0, i - window + 1):i + 1]]
        m = sum(chunk) / len(chunk)
        if m >= low + delta:
            return s
        low = min(low, m)
    return None


def candidate_rules() -> dict[str, Callable[[dict[str, Any]], int | None]]:
    """The early-warning rules the sweep calibrates, on a run dict with series ``resid`` (deepest layer's
    residual norm), ``tsim`` (t_sim(X^H)), ``loss``, ``inv_ratio`` (1 / first-last gradient ratio) and
    ``learned`` (first step with loss <= L - 0.5)."""
    rules: dict[str, Callable[[dict[str, Any]], int | None]] = {
        f"resid x{f:g}": functools.partial(lambda f, r: first_growth(r["resid"], f), f)
        for f in (2, 4, 8, 16, 32, 48, 64)}
    rules |= {f"t_sim(X^H) >= {t:g} after learning (loss <= L - 0.5)":
              functools.partial(lambda t, r: first_crossing(r["tsim"], t, r["learned"]), t)
              for t in (0.5, 0.7, 0.8, 0.85, 0.9)}
    rules |= {f"grad ratio <= {g:g}":
              functools.partial(lambda g, r: first_rise(r["inv_ratio"], 1 / g, 1 / g), g)
              for g in (0.1, 0.03, 0.01)}
    rules |= {f"loss +{d:g} over its minimum":
              functools.partial(lambda d, r: first_above_min(r["loss"], d), d)
              for d in (0.2, 0.3, 0.5)}
    return rules
