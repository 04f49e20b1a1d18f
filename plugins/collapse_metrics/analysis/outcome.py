"""A finished run's outcome from its ``collapse_metrics.jsonl``: collapsed / trained / plateau, the true
transition step from the dense metrics, and where the alarm (``state.py``) would have fired.

Ground truth (independent of the alarm's gradient test): with L the corpus frequency loss and the
loss and t_sim(X^H) averaged over the last ``window`` measured steps,
  * collapsed: final t_sim(X^H) >= 0.9 and final loss >= L - 0.15 (pinned at the frequency loss);
  * trained:   final loss <= L - 0.3;
  * plateau:   neither (still on the unigram plateau, or undecided).
Transition step of a collapsed run: the first measured step with t_sim(X^H) >= 0.9 from which on at
least 90% of the measured steps keep t_sim(X^H) >= 0.9 (brief wobbles neither start nor end it).
Delayed: collapsed, and the trailing-mean loss before the transition fell >= 0.5 nats below L.
The early warning (``early_warning.py``) is replayed on the deepest layer's residual norm where it applies
(that layer's FFN normalised its residual sum: t_sim_out recorded; post, deepnorm, Post layers of mix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..early_warning import DEFAULT_FACTOR, first_warning
from ..state import CollapseState, StateConfig, grad_ratio
from .runs import load_collapse_jsonl

COLLAPSED_TSIM, COLLAPSED_LOSS_GAP, TRAINED_GAP, DELAYED_GAP, SUSTAINED = 0.9, -0.15, -0.3, -0.5, 0.9


@dataclass
class StepRow:
    step: int
    loss: float | None
    tsim_head: float | None
    ratio: float | None
    flagged: bool | None  # the JSONL's own "collapsed" field when present
    resid_deep: float | None = None  # deepest layer's residual norm (ffn sublayer)
    post_norm: bool = True  # the deepest layer normalised its residual sum (the early warning applies)


def read_run(path: str | Path) -> list[StepRow]:
    """One row per measured step (parsed by ``figures.load_collapse_jsonl``: later records of a step
    supersede earlier ones)."""
    run = load_collapse_jsonl(path)
    grads = run.layer_grad()
    at = {int(s): i for i, s in enumerate(run.layer_steps)}

    def value(x: float) -> float | None:
        return None if math.isnan(x) else float(x)

    def ratio(step: int) -> float | None:
        if step not in at:
            return None
        row = grads[at[step]]
        return grad_ratio([{"layer": int(n), "grad_norm_layer": value(g)} for n, g in zip(run.layers, row,
                                                                                            strict=True)])

    collapsed = run.step["collapsed"]
    resid = run.layer["ffn"]["resid_norm"][:, -1] if "ffn" in run.layer and len(run.layers) else None
    post = run.deepest_normalised

    def deep(step: int) -> float | None:
        return None if resid is None or step not in at else value(resid[at[step]])

    return [StepRow(int(s), value(run.step["loss"][i]), value(run.step["t_sim_head"][i]), ratio(int(s)),
                    None if math.isnan(collapsed[i]) else bool(collapsed[i]), deep(int(s)), post)
            for i, s in enumerate(run.steps)]


def _mean(values: list[float | None]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


@dataclass
class Outcome:
    outcome: str
    transition_step: int | None
    delayed: bool
    best_gap: float  # min trailing-mean loss - L
    final_gap: float
    final_tsim: float
    final_grad_ratio: float
    alarm_step: int | None  # first step the state alarm fires (replayed on the records)
    alarm_final: bool  # the alarm's state at the last measured step
    warning_step: int | None = None  # first early warning (replayed where it applies)


def summarize(rows: list[StepRow], freq_loss: float, window: int = 5,
              config: StateConfig | None = None, warning_factor: float = DEFAULT_FACTOR) -> Outcome:
    config = config or StateConfig()
    losses = [r.loss for r in rows]
    trailing = [_mean(losses[max(0, i - window + 1):i + 1]) for i in range(len(rows))]
    final_loss = _mean(losses[-window:])
    final_tsim = _mean([r.tsim_head for r in rows[-window:]])
    final_gap = final_loss - freq_loss
    if final_tsim >= COLLAPSED_TSIM and final_gap >= COLLAPSED_LOSS_GAP:
        outcome = "collapsed"
    elif final_gap <= TRAINED_GAP:
        outcome = "trained"
    else:
        outcome = "plateau"
    transition = None
    if outcome == "collapsed":
        high = [r.tsim_head is not None and r.tsim_head >= COLLAPSED_TSIM for r in rows]
        transition = next((r.step for i, r in enumerate(rows)
                           if high[i] and sum(high[i:]) >= SUSTAINED * (len(rows) - i)),
                          next((r.step for r, h in zip(rows[-window:], high[-window:], strict=True) if h),
                               rows[-1].step))  # a final window high on average, its last step below
    before = [t for t, r in zip(trailing, rows, strict=True) if transition is None or r.step < transition]
    delayed = outcome == "collapsed" and bool(before) and min(before) - freq_loss <= DELAYED_GAP
    state, alarm_step, alarm_final = CollapseState(config), None, False
    for r in rows:
        flagged, _ = state.update(r.step, r.tsim_head, r.ratio)
        if flagged and alarm_step is None:
            alarm_step = r.step
        if flagged is not None:
            alarm_final = flagged
    ratio = next((r.ratio for r in reversed(rows) if r.ratio is not None), math.nan)
    best = min((t for t in trailing if math.isfinite(t)), default=math.nan)
    post = bool(rows) and rows[0].post_norm
    warning = first_warning([(r.step, r.resid_deep) for r in rows], warning_factor) if post else None
    return Outcome(outcome, transition, delayed, best - freq_loss, final_gap, final_tsim, ratio,
                   alarm_step, alarm_final, warning)
