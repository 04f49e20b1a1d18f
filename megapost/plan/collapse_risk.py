"""The planner's two collapse lines. The delayed-collapse line (``delayed_collapse_risk``): the run's
width, depth, warmup, tokens per step and lr schedule through the hazard law of ``megapost.study.law``.
The failure-to-start line (``collapse_risk``): the run's own factors (width, depth, warmup, tokens per
step, steps, sequence, vocabulary, heads, init) through the fitted collapse law
(``megapost.study.boundary_law``).

Inside the measured box the risk is ``high`` when the planned lr is above lr*'s interval, ``low`` below
it, ``uncertain`` inside. When any factor lies outside the box, or differs from a factor the data held
fixed, the line says ``extrapolated`` with lr / lr*, the interval and the factors it rests on, never a
flat high/low: the law has not been tested there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megapost.config.errors import ConfigError
from megapost.study import law as hazard_law
from megapost.study.boundary_law import UNINFORMATIVE, Law
from megapost.study.hazard import Schedule


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
    wide = hi > UNINFORMATIVE * lo
    p = None if wide else pred.p_collapse(lr, law.sigma)
    outside = bool(pred.extrapolated or pred.not_modelled)
    risk = "extrapolated" if outside else "high" if lr > hi else "low" if lr < lo else "uncertain"
    setting = (f"{placement}, {x['width']:g} x {x['depth']:g} layers, warmup {x['warmup']:g}, "
               f"{x['tokens_per_step']:,.0f} tokens/step, {x['decay_iters']:,.0f} steps after it")
    chance = ("no P(collapse)" if wide else f"P(collapse) per seed {p:.2f}"
              + (" if the law holds there" if outside else ""))
    line = (f"collapse risk: {risk} -- lr {lr:.3g} = {lr / pred.lr_star:.2g} x predicted "
            f"lr* {pred.lr_star:.3g} [{lo:.3g}, {hi:.3g}] ({law.level:.0%}; {chance}; {setting}; "
            f"fit {source})")
    if wide:
        line += (f"; the interval spans x{hi / lo:.2g} (> x{UNINFORMATIVE:g}): it cannot see past the "
                 f"{widest_term(law, x)} term")
    if pred.extrapolated:
        line += "; outside the measured box: " + ", ".join(pred.extrapolated)
    if pred.not_modelled:
        line += "; not measured, held at the fit's value: " + ", ".join(pred.not_modelled)
    return {"available": True, "risk": risk, "lr": lr, "lr_star": pred.lr_star, "interval": [lo, hi],
            "ratio": lr / pred.lr_star, "p_collapse": p, "extrapolated": pred.extrapolated,
            "not_modelled": pred.not_modelled, "factors": dict(x), "line": line}


def widest_term(law: Law, x: Mapping[str, float]) -> str:
    """The column of the best form whose own coefficient variance adds most to log lr*'s at ``x``."""
    b = law.best
    z = b.form.design(x)
    cols = b.form.columns()
    share = [(z[i] * z[i] * b.cov[i][i], c) for i, c in enumerate(cols) if c != "const"]
    return max(share)[1] if share else "const"


def delayed_collapse_risk(flags: Any, model: Any, path: str | None = None) -> dict[str, Any]:
    """The delayed-collapse record (its ``line``) of a run: ``flags`` (--lr, --min-lr, --lr-warmup-iters,
    --train-iters, --lr-decay-style, --global-batch-size, --seq-length, --norm-position), ``model`` its
    ModelConfig; the shipped hazard law unless ``path``."""
    if flags.norm_position != "post":
        return {"available": False,
                "line": "delayed collapse: the delayed-collapse law is fitted for Post-Norm only"}
    try:
        law = hazard_law.load(path)
    except ValueError as e:
        raise ConfigError(f"--hazard-law {e}") from None
    warmup = int(flags.lr_warmup_iters or 0)
    x = {"width": float(model.hidden_size), "depth": float(model.num_layers), "warmup": float(warmup),
         "tokens_per_step": float(flags.global_batch_size * flags.seq_length)}
    sched = Schedule(float(flags.lr), float(flags.min_lr or 0.0), warmup, int(flags.train_iters),
                     str(flags.lr_decay_style))
    return {"available": True, **hazard_law.risk_line(law, x, sched)}
