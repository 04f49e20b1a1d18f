"""The tables ``megapost-law boundary`` (megapost/study/boundary_cli.py) prints: the law with its
intervals, the factor table, the leave-one-out validation and the paper-180m test (the paper's bracket
is a test, never data)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from megapost.study.boundary_fit import NARROW, Probe, fit_law, groups, likelihood_ratio, varying
from megapost.study.boundary_law import FACTORS, INIT_CODE, UNINFORMATIVE, Z95, Form, Law, exponents
from megapost.study.report import PAPER_MIN_LR, PAPER_TRAIN_ITERS, PAPER_X

PAPER_BRACKET = (6e-4, 8e-4)  # QUANTITIES.md: 6e-4 stable for 40,000 steps, 8e-4 collapsed (~step 2644)
PAPER_VOCAB = 32000  # the Llama-2 tokenizer
PAPER_SEQ, PAPER_HEADS = 2048, 4


def paper_factors() -> dict[str, float]:
    """The paper-180m run's factors (the preset's; tests/test_study_law.py checks them against it)."""
    assert PAPER_MIN_LR == 0.0
    return {"width": PAPER_X["width"], "depth": PAPER_X["depth"], "warmup": PAPER_X["warmup"],
            "tokens_per_step": PAPER_X["tokens_per_step"],
            "decay_iters": PAPER_TRAIN_ITERS - PAPER_X["warmup"],
            "seq": PAPER_SEQ, "vocab": PAPER_VOCAB, "heads": PAPER_HEADS, "init": INIT_CODE["paper"]}


def law_lines(law: Law) -> list[str]:
    b = law.best
    lines = [f"form: {b.form.name} (best of {len(law.forms)} by AIC); sigma (seed noise, log lr) "
             f"{law.sigma:.3f}, tau (residual scatter of lr* between configurations, log lr) {b.tau:.3f}",
             "| form | log-likelihood | params | AIC | dAIC |", "|---|---|---|---|---|"]
    lines += [f"| {f['name']} | {f['loglik']:.1f} | {f['params']} | {f['aic']:.1f} | "
              f"{f['aic'] - law.forms[0]['aic']:.1f} |" for f in law.forms[:8]]
    terms = []
    for col, v, lo, hi in exponents(law):
        if col == "const":
            terms.insert(0, f"{math.exp(v):.3g} [{math.exp(lo):.3g}, {math.exp(hi):.3g}]")
        elif col.startswith("log "):
            terms.append(f"{col[4:]}^({v:+.2f} [{lo:+.2f}, {hi:+.2f}])")
        elif col == "init":
            terms.append(f"x {math.exp(v):.2f} [{math.exp(lo):.2f}, {math.exp(hi):.2f}] if init std")
        else:
            terms.append(f"exp(({v:+.2f} [{lo:+.2f}, {hi:+.2f}]) * {col})")
    lines.append("law: lr* = " + " * ".join(terms))
    if b.form.warmup != "none":
        lines.append(f"  warmup term {b.form.warmup}: " + ("log(1 + warmup/w0)" if b.form.warmup == "log1p"
                     else "warmup/(warmup + w0)") + f", w0 = {b.form.w0:g}")
    if law.fixed:
        lines.append("held fixed (constant in the data; predictions hold them there): "
                     + ", ".join(f"{f} {v:g}" for f, v in law.fixed.items()))
    if law.alternatives:
        lines.append("model-form term: intervals are the envelope with " + "; ".join(
            f"{a.form.name} (dAIC {a.delta_aic:.1f})" for a in law.alternatives))
    return lines


def reference(probes: Sequence[Probe]) -> dict[str, float]:
    """The most common value of each factor (the study's baseline)."""
    return {f: Counter(p.factors[f] for p in probes).most_common(1)[0][0] for f in FACTORS}


def factor_table(law: Law, probes: Sequence[Probe]) -> list[str]:
    """Per factor: the lr* ratio from its measured minimum to maximum (others at the baseline), its 95 %
    interval (coef covariance only) and the likelihood-ratio test of its term(s)."""
    ref, b = reference(probes), law.best
    lines = ["| factor | measured | lr*(max) / lr*(min) [95 %] | LR test (2 dlogL, p) |", "|---|---|---|---|"]
    for f in FACTORS:
        lo, hi = law.box[f]
        if f in law.fixed:
            lines.append(f"| {f} | {lo:g} only | not measured (held at {lo:g}) | – |")
            continue
        if f not in b.form.factors and f != "warmup":
            lines.append(f"| {f} | {lo:g} … {hi:g} | no term: varies only together with other factors, "
                         f"over <= {NARROW:g}x (ignored) | – |")
            continue
        if f == "warmup" and b.form.warmup == "none":
            stat, p = likelihood_ratio(probes, Form(b.form.factors, "log1p", 100.0), "warmup")
            lines.append(f"| {f} | {lo:g} … {hi:g} | no term (the best form has none) | {stat:.1f}, "
                         f"{p:.2g} (log1p w0 100) |")
            continue
        d = [u - v for u, v in zip(b.form.design({**ref, f: hi}), b.form.design({**ref, f: lo}), strict=True)]
        eff = sum(c * v for c, v in zip(b.coef, d, strict=True))
        sd = math.sqrt(max(0.0, sum(d[i] * b.cov[i][j] * d[j] for i in range(len(d)) for j in range(len(d)))))
        stat, p = likelihood_ratio(probes, b.form, f)
        lines.append(f"| {f} | {lo:g} … {hi:g} | {math.exp(eff):.3g} [{math.exp(eff - Z95 * sd):.3g}, "
                     f"{math.exp(eff + Z95 * sd):.3g}] | {stat:.1f}, {p:.2g} |")
    return lines


def bracket(ps: Sequence[Probe]) -> tuple[float, float]:
    """The measured bracket of one configuration: the lowest lr where most seeds collapse, and the
    highest lr below it where most do not (0 / inf when a side was never reached)."""
    ps = sorted(ps, key=lambda p: p.lr)
    hi = next((p.lr for p in ps if 2 * p.k >= p.n), math.inf)
    lo = max((p.lr for p in ps if 2 * p.k < p.n and p.lr < hi), default=0.0)
    return lo, hi


def loo_table(probes: Sequence[Probe], law: Law, factors: Sequence[str], draws: int,
              seed: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Refit without each value of each factor in turn (the best form, its terms that still vary),
    predict the held-out configurations, count the intervals that overlap the measured bracket."""
    rows, lines = [], ["| left out | configs | interval covers bracket | median abs log10(pred / bracket "
                       "centre) |", "|---|---|---|---|"]
    form = law.best.form
    for f in factors:
        values = sorted({p.factors[f] for p in probes})
        if len(values) < 3:
            lines.append(f"| {f} (only {len(values)} values: no leave-one-out) | – | – | – |")
            continue
        for v in values:
            train = [p for p in probes if p.factors[f] != v]
            keep = set(varying(train))
            sub = Form(tuple(t for t in form.factors if t in keep),
                       form.warmup if "warmup" in keep else "none", form.w0,
                       form.interaction and {"warmup", "depth"} <= keep)
            fit = fit_law(train, draws=draws, seed=seed, alternatives=False, form=sub)
            held = [ps for ps in groups([p for p in probes if p.factors[f] == v]).values()]
            covered, errs = 0, []
            for ps in held:
                lo, hi = bracket(ps)
                pred = fit.predict(ps[0].factors)
                covered += pred.interval[0] <= hi and pred.interval[1] >= lo
                if 0 < lo and hi < math.inf:
                    errs.append(abs(math.log10(pred.lr_star / math.sqrt(lo * hi))))
            med = sorted(errs)[len(errs) // 2] if errs else math.nan
            rows.append({"factor": f, "value": v, "configs": len(held), "covered": covered,
                         "median_abs_log10_error": med})
            lines.append(f"| {f} = {v:g} | {len(held)} | {covered}/{len(held)} | {med:.3f} |")
    total, cov = sum(r["configs"] for r in rows), sum(r["covered"] for r in rows)
    lines.append(f"overall: {cov}/{total} held-out configurations covered" if total else "no leave-one-out")
    return rows, lines


def aside_lines(law: Law, aside: Sequence[Probe], held: dict[str, float]) -> tuple[list[dict[str, Any]],
                                                                                list[str]]:
    """The configurations set aside (a factor they differ in varies nowhere alone): predicted vs measured."""
    if not held:
        return [], []
    rows, lines = [], ["not separable (vary only together with other factors), held at their most common "
                       "value: " + ", ".join(f"{f} {v:g}" for f, v in held.items()),
                       "| set aside (not fitted) | measured bracket | predicted lr* [95 %] | covered |",
                       "|---|---|---|---|"]
    for ps in groups(aside).values():
        x = ps[0].factors
        lo, hi = bracket(ps)
        pred = law.predict(x)
        cov = pred.interval[0] <= hi and pred.interval[1] >= lo
        name = ", ".join(f"{f} {x[f]:g}" for f in FACTORS if x[f] != law.box[f][0] or f in held)
        rows.append({"factors": x, "bracket": [lo, hi], "lr_star": pred.lr_star,
                     "interval": list(pred.interval), "covered": cov})
        lines.append(f"| {name} | [{lo:.3g}, {hi:.3g}] | {pred.lr_star:.3g} [{pred.interval[0]:.3g}, "
                     f"{pred.interval[1]:.3g}] | {'yes' if cov else 'no'} |")
    return rows, lines


def paper_test(law: Law) -> tuple[dict[str, Any], list[str]]:
    """The law at paper-180m (warmup 2000, 256 x 2048 tokens, 40,000 steps) against its bracket."""
    x = paper_factors()
    pred = law.predict(x)
    lo, hi = PAPER_BRACKET
    a, b = pred.interval
    hit = a <= hi and b >= lo
    wide = b > UNINFORMATIVE * a
    miss = 1.0 if hit else (lo / pred.lr_star if pred.lr_star < lo else pred.lr_star / hi)
    ref = {f: min(max(x[f], law.box[f][0]), law.box[f][1]) for f in FACTORS}
    shares = []
    for f in FACTORS:
        if f in law.fixed or ref[f] == x[f]:
            continue
        mu_in = law.best.mu_sd({**x, f: ref[f]})[0]
        shares.append((abs(math.log(pred.lr_star) - mu_in), f, math.exp(math.log(pred.lr_star) - mu_in)))
    shares.sort(reverse=True)
    out = {"factors": x, "lr_star": pred.lr_star, "interval": list(pred.interval),
           "bracket": list(PAPER_BRACKET),
           "interval_overlaps_bracket": hit, "uninformative": wide, "miss_factor": miss,
           "p_collapse": {f"{lr:g}": pred.p_collapse(lr, law.sigma) for lr in (6e-4, 8e-4, 1.2e-3, 1.8e-3)},
           "extrapolated": pred.extrapolated, "not_modelled": pred.not_modelled,
           "extrapolation_factors": {f: r for _, f, r in shares}}
    lines = [f"paper-180m test (warmup 2000, 256 x 2048 tokens/step, 40,000 steps, vocab {PAPER_VOCAB}): "
             f"predicted lr* {pred.lr_star:.3g} [{a:.3g}, {b:.3g}] vs the paper's bracket ({lo:g} stable, "
             f"{hi:g} collapsed): " + (f"UNINFORMATIVE: the interval spans x{b / a:.2g}" if wide else
                                       "the interval overlaps the bracket" if hit else
                                       f"MISS by x{miss:.2f} ({'below' if pred.lr_star < lo else 'above'})"),
             "  P(collapse) per seed: " + ", ".join(f"lr {k}: {v:.2f}" for k, v in out["p_collapse"].items()),
             "  extrapolated beyond the measured box: " + (", ".join(pred.extrapolated) or "none"),
             "  not modelled (held at the data's value): " + (", ".join(pred.not_modelled) or "none")]
    if shares:
        lines.append("  lr* change from extrapolating each factor past the box edge: " + ", ".join(
            f"{f} x{r:.3g}" for _, f, r in shares) + f" (largest: {shares[0][1]})")
    return out, lines


