"""The predicted Post-Norm collapse risk of a plan, from a fitted boundary lr*(d, L) (a JSON file written by
``tools/collapse_boundary.py``; read here, the planner does not import the plugin).

lr*(d, L) = exp(log_a) d^b L^c is the peak lr at which P(collapse) = 1/2 at the fit's warmup, tokens and
sequence length; its interval comes from the draws stored in the file. The risk is ``high`` when the
planned lr is above the interval, ``low`` below it, ``uncertain`` inside. Every prediction outside the
fitted widths/depths is an extrapolation and says so.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megapost.config.errors import ConfigError

DEFAULT_BOUNDARY = Path("runs") / "collapse_boundary" / "boundary.json"
SHIPPED_BOUNDARY = Path(__file__).with_name("collapse_boundary_post.json")  # examples/scaling_study.sh's fit
SHIPPED_LABEL = "megapost/plan/collapse_boundary_post.json, shipped: the default study on CPU"
ENV = "MEGAPOST_COLLAPSE_BOUNDARY"


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    i = int(math.floor(pos))
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (pos - i)


def predict(fit: dict[str, Any], width: float, depth: float) -> dict[str, Any]:
    """lr*(width, depth): point estimate, 95 % interval over the stored draws, inside the fitted range."""
    x = (1.0, math.log(width), math.log(depth))
    coef = (fit["log_a"], fit["b_width"] or 0.0, fit["c_depth"] or 0.0)
    vals = [sum(a * b for a, b in zip(row, x, strict=True)) for row in fit["samples"]]
    r = fit["range"]
    inside = r["widths"][0] <= width <= r["widths"][1] and r["depths"][0] <= depth <= r["depths"][1]
    return {"lr_star": math.exp(sum(a * b for a, b in zip(coef, x, strict=True))),
            "interval": [math.exp(_quantile(vals, 0.025)), math.exp(_quantile(vals, 0.975))],
            "inside": inside}


def load_boundary(path: str | None) -> tuple[dict[str, Any] | None, str]:
    """The boundary JSON (``path``, else $MEGAPOST_COLLAPSE_BOUNDARY, else runs/collapse_boundary/
    boundary.json when present, else the fit shipped with megapost: the default study's, measured on CPU)
    and where it came from; (None, reason) when there is none."""
    chosen = path or os.environ.get(ENV) or next(
        (str(f) for f in (DEFAULT_BOUNDARY, SHIPPED_BOUNDARY) if f.is_file()), None)
    if chosen is None:
        return None, "no boundary fit (run tools/collapse_boundary.py, or pass --collapse-boundary FILE)"
    try:
        data = json.loads(Path(chosen).read_text(encoding="utf-8"))
        data["fit"]["samples"], data["fit"]["range"]  # noqa: B018 (the keys predict reads)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--collapse-boundary {chosen}: not a tools/collapse_boundary.py JSON "
                          f"({type(e).__name__}: {e})") from None
    return data, SHIPPED_LABEL if chosen == str(SHIPPED_BOUNDARY) else chosen


def collapse_risk(data: dict[str, Any] | None, source: str, placement: str, width: int, depth: int,
                  lr: float, warmup: int) -> dict[str, Any]:
    """The risk record the planner prints (``render_risk``) and puts in its JSON."""
    if data is None:
        return {"available": False, "line": f"collapse risk: {source}"}
    if data.get("placement") != placement:
        return {"available": False, "line": f"collapse risk: the boundary in {source} was fitted for "
                f"--norm-position {data.get('placement')}, not {placement}"}
    p = predict(data["fit"], width, depth)
    lo, hi = p["interval"]
    risk = "high" if lr > hi else "low" if lr < lo else "uncertain"
    notes = [] if p["inside"] else ["outside the fitted range (extrapolation)"]
    if warmup != data.get("warmup"):
        notes.append(f"fitted at warmup {data.get('warmup')} steps, {data.get('tokens'):,} tokens, seq "
                     f"{data.get('seq_length')}; your warmup {warmup} is not modelled")
    line = (f"collapse risk: {risk} -- lr {lr:.3g} vs predicted lr* {p['lr_star']:.3g} "
            f"[{lo:.3g}, {hi:.3g}] (P(collapse) = 0.5, {placement}, {width} x {depth} layers; fit {source})"
            + "".join(f"; {n}" for n in notes))
    return {"available": True, "risk": risk, "lr": lr, **p, "notes": notes, "line": line}
