"""The tables ``megapost-law`` prints: the relabelled outcomes, the hazard fit with an interval per term,
the alternatives, the leave-one-configuration-out coverage and the paper-180m lines (a test, never data)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from megapost.study.events import DEFAULT, DELAYED, FAILED, SURVIVED, Criterion
from megapost.study.hazard import Schedule, log_lr_star
from megapost.study.law import HazardLaw, risk_line
from megapost.study.results import Row

# the paper's 180M run (QUANTITIES.md; the preset paper-180m): 512 x 48, 256 x 2048 tokens per step,
# 2000 warmup of 40000 cosine steps to 0; its bracket: 6e-4 stable 40,000 steps, 8e-4 collapsed (~2644)
PAPER_X = {"width": 512.0, "depth": 48.0, "warmup": 2000.0, "tokens_per_step": 256.0 * 2048}
PAPER_LRS = (6e-4, 8e-4, 1.2e-3, 1.8e-3)
PAPER_TRAIN_ITERS, PAPER_MIN_LR = 40000, 0.0


def paper_schedule(lr: float) -> Schedule:
    return Schedule(lr, PAPER_MIN_LR, int(PAPER_X["warmup"]), PAPER_TRAIN_ITERS, "cosine")


def relabel_table(rows: Sequence[Row], crit: Criterion = DEFAULT) -> list[str]:
    """Per configuration: failed to start / delayed / survived, and the delayed runs' lr and step."""
    counts: dict[str, Counter] = {}
    delayed: dict[str, list[str]] = {}
    source: dict[str, str] = {}
    for r in rows:
        ev = r.event(crit)
        counts.setdefault(r.config, Counter())[ev.kind] += 1
        source[r.config] = "series" if r.series is not None else "row"
        if ev.kind == DELAYED:
            delayed.setdefault(r.config, []).append(f"{r.number('lr'):g}/s{int(r.number('seed'))}@{ev.step}")
    lines = [f"relabelled ({crit.describe()}):",
             "| configuration | from | failed to start | delayed | survived | delayed runs lr/seed@step |",
             "|---|---|---|---|---|---|"]
    total: Counter = Counter()
    for c in sorted(counts):
        n = counts[c]
        total += n
        lines.append(f"| {c} | {source[c]} | {n[FAILED]} | {n[DELAYED]} | {n[SURVIVED]} | "
                     f"{' '.join(delayed.get(c, []))} |")
    lines.append(f"| all {sum(total.values())} runs | | {total[FAILED]} | {total[DELAYED]} | "
                 f"{total[SURVIVED]} | |")
    return lines


def fit_lines(law: HazardLaw) -> list[str]:
    b = law.best
    sd = np.sqrt(np.diag(b.cov))
    lines = [f"hazard law: {b.form.name}; {b.events} delayed collapses in {b.runs} runs that learned "
             f"({law.provenance.get('configs')} configurations); log-likelihood {b.loglik:.1f}, "
             f"AIC {b.aic:.1f}",
             "| form | log-likelihood | params | AIC | dAIC |", "|---|---|---|---|---|"]
    forms = law.provenance.get("forms", [])
    lines += [f"| {f['name']} | {f['loglik']:.1f} | {f['params']} | {f['aic']:.1f} | "
              f"{f['aic'] - forms[0]['aic']:.1f} |" for f in forms[:8]]
    lines += ["| term | coefficient [95 %] | as lr* exponent (-c / beta) |", "|---|---|---|"]
    beta = b.theta[1]
    for c, v, s in zip(b.form.columns(), b.theta, sd, strict=True):
        exp = "" if c in ("const", "log lr") or not c.startswith("log") else f"{-v / beta:+.2f}"
        lines.append(f"| {c} | {v:+.2f} [{v - 1.96 * s:+.2f}, {v + 1.96 * s:+.2f}] | {exp} |")
    kinds = Counter(a.kind for a in law.alternatives)
    lines.append("alternatives in the interval: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    return lines


def paper_lines(law: HazardLaw) -> list[str]:
    lines = ["paper-180m post, warmup 2000 (a test, never data): 6e-4 stable 40,000 steps, 8e-4 collapsed"]
    for lr in PAPER_LRS:
        rec = risk_line(law, PAPER_X, paper_schedule(lr))
        lines.append(f"  lr {lr:g}: {rec['line']}")
    s = law.spread(PAPER_X, paper_schedule(8e-4))
    lines.append(f"  lr* {s.lr_star:.3g}: parameter interval [{s.param[0]:.3g}, {s.param[1]:.3g}] "
                 f"(x{s.param[1] / s.param[0]:.3g}); envelope [{s.interval[0]:.3g}, {s.interval[1]:.3g}] "
                 f"(x{s.ratio:.3g}); contains 7e-4: {s.interval[0] <= 7e-4 <= s.interval[1]}")
    for k, (a, b) in s.by_kind.items():
        lines.append(f"    {k} alternatives: [{a:.3g}, {b:.3g}] (x{b / a:.3g})")
    sched = paper_schedule(8e-4)
    for br in law.alternatives:
        star = math.exp(float(log_lr_star(br.fit.theta, br.fit.form, PAPER_X, sched)[0]))
        lines.append(f"      {br.kind}: {br.name}: lr* {star:.3g}")
    lines.append("    parameter interval with one term known exactly: " + ", ".join(
        f"{c} x{v:.3g}" for c, v in sorted(s.conditional.items(), key=lambda kv: kv[1])))
    return lines


def loo_lines(rows: list[dict[str, object]]) -> list[str]:
    tested = [r for r in rows if r["covered"] is not None]
    cov = sum(bool(r["covered"]) for r in tested)
    lines = [f"leave-one-configuration-out: observed delayed collapses inside the 95 % predictive band in "
             f"{cov} of {len(tested)} configurations",
             "| configuration | runs | observed | expected | band |", "|---|---|---|---|---|"]
    for r in rows:
        exp = "" if r["expected"] is None else f"{r['expected']:.2f}"
        band = r["band"] or r.get("note")
        lines.append(f"| {r['config']} | {r['runs']} | {r['observed']} | {exp} | {band} |")
    return lines
