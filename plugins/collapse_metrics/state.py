"""The collapsed-state alarm: is the network collapsed *now*? Decided per measured step, no warm-up.

Definition 3.7 / Theorem 3.8: in the collapsed state the head input is (nearly) row-constant and,
because a row-constant hidden state stays row-constant through attention, SwiGLU and RMSNorm and
the zero-column-sum gradient propagates backward, the parameter gradients of the collapsed layers
and of every layer before them vanish. The state is therefore near-stationary: nothing below the
collapsed layers can move it. A healthy run that passes through the unigram plateau early also has
t_sim(X^H) ~ 1 and the loss at the frequency loss, but its early layers still receive gradient
(layer-1 / layer-L ratio 0.4..10 in Pre-Norm, 5e-2..1 in a healthy Post-Norm), so it leaves the plateau.

A measured step is *collapsed* when both

    t_sim(X^H) >= tsim_min                                      (rank collapse of the head input)
    ||grad W_layer first|| / ||grad W_layer last|| <= grad_ratio_max   (gradients vanished upstream)

with the first and last *measured* layers (``--collapse-layers``; at least two are needed). Measured
(docs/readme/collapse.md): collapsed runs fall to 1e-9..1e-12 at 8-12 layers; at 2 layers, where the
collapse reaches only the last layer, to 2e-4..3e-2; healthy runs on the unigram plateau stayed above
1e-2 (the 4-layer tiny-cpu example touched 1.01e-2 at step 50 before it recovered) and Pre-Norm above
0.4. The default 1e-3 keeps a factor 10 below every healthy value; the price is a lag after the
transition while the ratio decays. Steps without gradients (the forward-only step 0) are undecided.
Once in the state, a step stays collapsed while t_sim(X^H) >= tsim_min (the gradient ratio of a
shallow collapsed net fluctuates by a decade from step to step; the state ends when the rank collapse
of the head input does). The alarm line is printed on entering the state and, once, on leaving it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class StateConfig:
    tsim_min: float = 0.95
    grad_ratio_max: float = 1e-3


def grad_ratio(records: list[dict[str, Any]]) -> float | None:
    """||grad|| of the first measured layer over the last's (``grad_norm_layer`` of the layer records);
    None with fewer than two layers or missing gradients. 0/0 is 0 (both vanished: collapsed upstream)."""
    by_layer = {r["layer"]: r.get("grad_norm_layer") for r in records if r.get("grad_norm_layer") is not None}
    if len(by_layer) < 2:
        return None
    first, last = by_layer[min(by_layer)], by_layer[max(by_layer)]
    if not (math.isfinite(first) and math.isfinite(last)):
        return None
    if last <= 0.0:
        return 0.0 if first <= 0.0 else math.inf
    return first / last


def is_collapsed(tsim_head: float | None, ratio: float | None, config: StateConfig) -> bool | None:
    """The state of one measured step (None: undecided, e.g. no gradients)."""
    if tsim_head is None or ratio is None or not math.isfinite(tsim_head):
        return None
    return tsim_head >= config.tsim_min and ratio <= config.grad_ratio_max


@dataclass
class CollapseState:
    """Tracks the state over measured steps; ``update`` returns the alert line on a change."""

    config: StateConfig
    collapsed: bool = False
    since: int | None = None  # first step of the current collapsed stretch

    def update(self, step: int, tsim_head: float | None,
               ratio: float | None) -> tuple[bool | None, str | None]:
        state = is_collapsed(tsim_head, ratio, self.config)
        if self.collapsed and state is False and tsim_head >= self.config.tsim_min:
            state = True  # hysteresis: the state ends when the head input's rank collapse does
        if state is None or state == self.collapsed:
            return state, None
        self.collapsed = state
        if state:
            self.since = step
            return state, (f"[collapse] COLLAPSED at step {step}: t_sim(X^H) {tsim_head:.3f}, "
                           f"first/last-layer gradient ratio {ratio:.1e} "
                           "(gradients vanished upstream: near-stationary)")
        since, self.since = self.since, None
        return state, (f"[collapse] recovered at step {step} (collapsed since step {since}): t_sim(X^H) "
                       f"{tsim_head:.3f}, gradient ratio {ratio:.1e}")

    def state_dict(self) -> dict[str, Any]:
        return {"collapsed": self.collapsed, "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collapsed, self.since = bool(state["collapsed"]), state.get("since")
