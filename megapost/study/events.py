"""Three outcomes of a Post-Norm run, each with its step (issue 40): failed to start, delayed collapse,
survived.

With L the corpus frequency loss and the loss a trailing mean over ``window`` measured steps:

* **failed to start**: the loss never came ``learned_gap`` (0.3 nats) below L. Its step is the
  transition into the pinned state when it reached one (the initialisation-time collapse of the
  paper's no-warmup runs), else none. These runs belong to the failure-to-start (boundary) law.
* **delayed collapse** (the paper's event): the run learned, then from step s on it is pinned --
  t_sim(X^H) >= 0.9, loss >= L - 0.15 and the first/last-layer gradient ratio <= 1e-2 -- at >= 90 % of
  the measured steps of [s, s + K], K = ``sustain`` steps (100: the paper's loss stays at L for the rest
  of the run; 100 steps is 20 measurements at the study's interval 5). The event step is s, moved back over
  the measured steps just before it where t_sim and the gradient ratio already held (the trailing loss
  lags them by up to ``window`` measurements).
* **survived**: learned and not collapsed. The run was at risk until its last step minus K (a
  collapse starting later could not be confirmed): it is right-censored there.

``from_series`` decides from a run's per-step series (``collapse_metrics.jsonl`` or the compact
``series/*.csv`` of study/results); ``from_row`` from a results.csv row alone (the shipped runs of
the older sweeps, whose series were not kept): learned is ``best_gap`` <= -learned_gap, the event step
is the row's ``transition_step`` (first step from which t_sim(X^H) >= 0.9 at >= 90 % of the later
steps), pinned is the final-window state (``final_tsim``, ``final_gap``, ``final_grad_ratio``) and the
sustain test is train_iters - transition_step >= K; the step at which such a run learned is unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

FAILED, DELAYED, SURVIVED = "failed_to_start", "delayed", "survived"


@dataclass(frozen=True)
class Criterion:
    """The thresholds of the three outcomes (see the module docstring)."""

    learned_gap: float = 0.3
    pinned_gap: float = 0.15
    tsim: float = 0.9
    grad_ratio: float = 1e-2
    sustain: int = 100
    window: int = 5
    fraction: float = 0.9

    def describe(self) -> str:
        return (f"learned: loss >= {self.learned_gap:g} nats below L; delayed collapse: then t_sim(X^H) >= "
                f"{self.tsim:g}, loss >= L - {self.pinned_gap:g}, grad ratio <= {self.grad_ratio:g} at >= "
                f"{self.fraction:.0%} of the steps of [s, s + {self.sustain}]")


DEFAULT = Criterion()
# the label-threshold alternatives the law's interval carries (refits under each)
ALTERNATIVES = {"K 50": replace(DEFAULT, sustain=50), "K 200": replace(DEFAULT, sustain=200),
                "learned 0.5": replace(DEFAULT, learned_gap=0.5),
                "ratio 1e-3": replace(DEFAULT, grad_ratio=1e-3),
                "ratio 3e-2": replace(DEFAULT, grad_ratio=3e-2)}


@dataclass(frozen=True)
class Event:
    """A run's outcome: ``kind``, its ``step`` (delayed: the event step; failed: the pinned transition or
    None; survived: None), the step it learned (None: not known) and the last step it was at risk."""

    kind: str
    step: int | None
    learned_step: int | None
    at_risk_until: int


def _trailing(values: Sequence[float | None], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - window + 1):i + 1] if v is not None and math.isfinite(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def from_series(steps: Sequence[int], loss: Sequence[float | None], tsim: Sequence[float | None],
                ratio: Sequence[float | None], freq_loss: float, crit: Criterion = DEFAULT) -> Event:
    """The outcome of one run from its measured steps (ascending)."""
    if not steps:
        raise ValueError("a run with no measured step")
    gap = [g - freq_loss for g in _trailing(loss, crit.window)]
    last = int(steps[-1])
    high = [t is not None and t >= crit.tsim and g >= -crit.pinned_gap
            for t, g in zip(tsim, gap, strict=True)]
    learned = next((i for i, g in enumerate(gap) if g <= -crit.learned_gap), None)
    if learned is None:
        onset = next((int(steps[i]) for i in range(len(steps))
                      if high[i] and _sustained(steps, high, i, crit)), None)
        return Event(FAILED, onset, None, last)
    pinned = [h and r is not None and r <= crit.grad_ratio for h, r in zip(high, ratio, strict=True)]
    for i in range(learned + 1, len(steps)):
        if int(steps[i]) + crit.sustain > last:
            break
        if pinned[i] and _sustained(steps, pinned, i, crit):
            onset = i  # back to where t_sim and the gradient ratio crossed (the trailing loss lags them)
            while onset - 1 > learned and _state(tsim[onset - 1], ratio[onset - 1], crit):
                onset -= 1
            return Event(DELAYED, int(steps[onset]), int(steps[learned]), int(steps[onset]))
    return Event(SURVIVED, None, int(steps[learned]), last - crit.sustain)


def _state(tsim: float | None, ratio: float | None, crit: Criterion) -> bool:
    return tsim is not None and tsim >= crit.tsim and ratio is not None and ratio <= crit.grad_ratio


def _sustained(steps: Sequence[int], flags: Sequence[bool], i: int, crit: Criterion) -> bool:
    """At >= ``fraction`` of the measured steps in [steps[i], steps[i] + sustain] the flag holds, and that
    window was observed to its end."""
    end = int(steps[i]) + crit.sustain
    if end > int(steps[-1]):
        return False
    inside = [f for s, f in zip(steps, flags, strict=True) if int(steps[i]) <= int(s) <= end]
    return sum(inside) >= crit.fraction * len(inside)


def _num(row: Mapping[str, str], key: str) -> float:
    v = row.get(key)
    return math.nan if v in (None, "") else float(v)


def from_row(row: Mapping[str, str], crit: Criterion = DEFAULT) -> Event:
    """The outcome of a results.csv row (no series; see the module docstring)."""
    last = int(float(row["train_iters"]))
    transition = _num(row, "transition_step")
    pinned_end = (_num(row, "final_tsim") >= crit.tsim and _num(row, "final_gap") >= -crit.pinned_gap)
    if not _num(row, "best_gap") <= -crit.learned_gap:
        onset = int(transition) if pinned_end and math.isfinite(transition) else None
        return Event(FAILED, onset, None, last)
    ratio = _num(row, "final_grad_ratio")
    if (pinned_end and ratio <= crit.grad_ratio and math.isfinite(transition)
            and last - transition >= crit.sustain):
        return Event(DELAYED, int(transition), None, int(transition))
    return Event(SURVIVED, None, None, last - crit.sustain)
