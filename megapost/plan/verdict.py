"""The planner's one collapse verdict (issue 52): the failure-to-start record (``collapse_risk``) and the
delayed-collapse record (``delayed_collapse_risk``) in one line a researcher can act on.

The two laws answer different questions about one run: failing to start (the run never learns: the
boundary law, measured on short runs) applies to the first steps, during and just after warmup; a delayed
collapse (the run learns, then collapses: the hazard law) applies after, up to the last step. Each law's
level is where the planned lr sits: by its P(collapse) band where it has one (all above 1/2: high, all
below: low), else against its predicted lr* interval (above: high, below: low, inside: uncertain).
The verdict is the worse level; that law dominates (on a tie: the one with a P(collapse), then the
larger P). Numbers are the records' own: nothing is refitted or combined here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ORDER = {"low": 0, "uncertain": 1, "high": 2}
NAMES = {"tokens_per_step": "tokens/step", "decay_iters": "steps after warmup", "seq": "sequence length",
         "vocab": "vocabulary", "warmup": "warmup steps", "init": "init", "heads": "heads"}
BOUND = re.compile(r"^(\S+) (\S+) ([<>]) (\S+)$")


def _level(rec: Mapping[str, Any], lr: float) -> str:
    """Where the planned lr sits: by the P(collapse) band when the record has one (its lower end above 1/2:
    high, its upper end below: low), else against the predicted lr* interval."""
    band = rec.get("p_interval") if rec.get("p_collapse") is not None else None
    if band:
        return "high" if band[0] > 0.5 else "low" if band[1] < 0.5 else "uncertain"
    lo, hi = rec["interval"]
    return "high" if lr > hi else "low" if lr < lo else "uncertain"


def _plain(item: str) -> str:
    """``"tokens_per_step 524,288 > 4,096"`` -> ``"tokens/step 524,288 (measured up to 4,096)"``."""
    m = BOUND.match(item)
    if not m:
        return item
    name, value, op, bound = m.groups()
    return f"{NAMES.get(name, name)} {value} (measured {'up to' if op == '>' else 'from'} {bound})"


def _clause(rec: Mapping[str, Any], what: str, lr: float) -> str:
    if not rec.get("available"):
        reason = rec["line"].split(":", 1)[1].strip() if ":" in rec["line"] else rec["line"]
        return f"{what}: no estimate ({reason})"
    lo, hi = rec["interval"]
    star = f"predicted lr* {rec['lr_star']:.3g} [{lo:.3g}, {hi:.3g}]"
    p = rec.get("p_collapse")
    if p is None:
        why = (f"the measured runs hold no such collapse for {', '.join(rec['unmeasured'])}"
               if rec.get("unmeasured")
               else f"that range is x{hi / lo:.2g} wide, too wide to rank lr {lr:.3g}")
        return f"{what}: {_level(rec, lr)}, no P ({star}; {why})"
    band = rec.get("p_interval")
    return (f"{what}: {_level(rec, lr)}, P {p:.2f}" + (f" [{band[0]:.2f}, {band[1]:.2f}]"
            if band else " per seed") + f" ({star})")


def _rank(rec: Mapping[str, Any], lr: float) -> tuple[int, int, float]:
    if not rec.get("available"):
        return (-1, 0, 0.0)
    p = rec.get("p_collapse")
    return (ORDER[_level(rec, lr)], p is not None, p or 0.0)


def verdict(start: Mapping[str, Any], delayed: Mapping[str, Any], lr: float, train_iters: int) -> str:
    """The one ``collapse risk:`` line the planner prints, from the two records at the planned ``lr``."""
    parts = {"start": (start, "failing to start (first steps, during and just after warmup)"),
             "delayed": (delayed, f"collapsing after it has learned (by step {train_iters:,})")}
    ranked = sorted(parts, key=lambda k: _rank(parts[k][0], lr), reverse=True)
    top = parts[ranked[0]][0]
    outside = sorted({_plain(e) for rec, _ in parts.values() for e in rec.get("extrapolated") or []})
    held = [e for rec, _ in parts.values() for e in rec.get("not_modelled") or []]
    if not top.get("available"):
        head = f"collapse risk: unknown at lr {lr:.3g} (neither law covers this run)"
    else:
        head = (f"collapse risk: {_level(top, lr)} at lr {lr:.3g} ("
                f"{'failing to start' if ranked[0] == 'start' else 'a delayed collapse'} dominates"
                + ("; extrapolated" if outside or held else "") + ")")
    line = head + " -- " + "; ".join(_clause(*parts[k], lr) for k in ranked)
    if outside:
        line += "; extrapolated beyond the measured runs: " + ", ".join(outside)
    if held:
        line += "; never varied in the measured runs (assumed not to matter): " + ", ".join(held)
    return line
