"""The planner's collapse-risk line: the run's own factors (width, depth, warmup, tokens per step, steps,
sequence, vocabulary, heads, init) through the fitted collapse law (``megapost.plan.collapse_law``).

Inside the measured box the risk is ``high`` when the planned lr is above lr*'s interval, ``low`` below
it, ``uncertain`` inside. When any factor lies outside the box, or differs from a factor the data held
fixed, the line says ``extrapolated`` with lr / lr*, the interval and the factors it rests on, never a
flat high/low: the law has not been tested there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megapost.plan.collapse_law import Law

UNINFORMATIVE = 100.0  # an interval wider than this ratio is reported as not constraining lr*


def collapse_risk(law: Law | None, source: str, placement: str, x: Mapping[str, float],
                  lr: float) -> dict[str, Any]:
    """The risk record the planner prints (its ``line``) and puts in its JSON."""
    if law is None:
        return {"available": False, "line": f"collapse risk: {source}"}
    if law.placement != placement:
        return {"available": False, "line": f"collapse risk: the law in {source} was fitted for "
                f"--norm-position {law.placement}, not {placement}"}
    pred = law.predict(x)
    lo, hi = pred.interval
    p = pred.p_collapse(lr, law.sigma)
    outside = bool(pred.extrapolated or pred.not_modelled)
    risk = "extrapolated" if outside else "high" if lr > hi else "low" if lr < lo else "uncertain"
    setting = (f"{placement}, {x['width']:g} x {x['depth']:g} layers, warmup {x['warmup']:g}, "
               f"{x['tokens_per_step']:,.0f} tokens/step, {x['decay_iters']:,.0f} steps after it")
    line = (f"collapse risk: {risk} -- lr {lr:.3g} = {lr / pred.lr_star:.2g} x predicted lr* "
            f"{pred.lr_star:.3g} [{lo:.3g}, {hi:.3g}] ({law.level:.0%}; P(collapse) per seed {p:.2f}"
            + (" if the law holds there" if outside else "") + f"; {setting}; fit {source})")
    if hi > UNINFORMATIVE * lo:
        line += f"; the interval spans x{hi / lo:.2g}: the law does not constrain lr* here"
    if pred.extrapolated:
        line += "; outside the measured box: " + ", ".join(pred.extrapolated)
    if pred.not_modelled:
        line += "; not measured, held at the fit's value: " + ", ".join(pred.not_modelled)
    return {"available": True, "risk": risk, "lr": lr, "lr_star": pred.lr_star, "interval": [lo, hi],
            "ratio": lr / pred.lr_star, "p_collapse": p, "extrapolated": pred.extrapolated,
            "not_modelled": pred.not_modelled, "factors": dict(x), "line": line}
