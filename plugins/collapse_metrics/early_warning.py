"""The early warning (``--collapse-early-warning``): the paper's mechanism seen before the collapse.

Post-Norm normalises the residual stream itself, y = X + F(X) -> RMSNorm(y). When ||y|| grows the
norm's factor sqrt(d)/||y|| falls, c(y, alpha) drops below 1 in the deep layers, the gradient to the
earlier layers decays and t_sim jumps (section 3). Measured on the delayed runs
(docs/readme/collapse.md), the first of these to move is the deepest layer's residual norm: the
norm input of its last sublayer. A measured step *warns* when

    resid_norm(deepest layer, ffn) >= factor * (its minimum over the earlier measured steps)

(default factor 4: the healthy trained Post-Norm runs of the sweep stayed below 3.9). Under
Pre-Norm the residual stream grows by design and the norm sits on the branch, so the rule reads
nothing there: the warning is only armed where the deepest measured layer's FFN residual sum is the
input of a norm after the add (``early_warning_applies``: post, deepnorm, mix when that layer is one
of its Post-Norm layers; not pre, sandwich, pre-scaled, dyt, hybrid, whose last residual sum feeds the
next layer or the final norm unnormalised; docs/placements.md). The factor was calibrated on Post-Norm
only. It latches (one line per run, or per rollback of ``--collapse-guard``, which restores this state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megapost.plugin_api import ModelView

DEFAULT_FACTOR = 4.0


def early_warning_applies(model: ModelView, layers: Sequence[int]) -> bool:
    """Whether the rule reads the Post-Norm mechanism of ``model``: the FFN of the deepest measured layer
    normalises its residual sum after the add."""
    return bool(layers) and model.ffn_normalises_sum(max(layers))


def deepest_resid_norm(records: list[dict[str, Any]]) -> float | None:
    """The residual norm at the last sublayer of the deepest measured layer (None when missing)."""
    deep = [r for r in records if r.get("resid_norm") is not None and math.isfinite(r["resid_norm"])]
    if not deep:
        return None
    last = max(r["layer"] for r in deep)
    values = [r["resid_norm"] for r in deep if r["layer"] == last and r["sublayer"] == "ffn"]
    return values[-1] if values else None


@dataclass
class EarlyWarning:
    """Running minimum of the deepest residual norm; ``update`` returns (warned, line-on-first-warning)."""

    factor: float = DEFAULT_FACTOR
    minimum: float | None = None
    warned_at: int | None = None

    def update(self, step: int, resid: float | None) -> tuple[bool, str | None]:
        if resid is None or resid <= 0.0:
            return self.warned_at is not None, None
        line = None
        if self.minimum is not None and self.warned_at is None and resid >= self.factor * self.minimum:
            self.warned_at = step
            line = (f"[collapse] EARLY WARNING at step {step}: deepest-layer residual norm {resid:.3g} is "
                    f"{resid / self.minimum:.1f}x its minimum {self.minimum:.3g} (Post-Norm collapse "
                    "mechanism: sqrt(d)/||y|| and c are falling)")
        self.minimum = resid if self.minimum is None else min(self.minimum, resid)
        return self.warned_at is not None, line

    def state_dict(self) -> dict[str, Any]:
        return {"minimum": self.minimum, "warned_at": self.warned_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.minimum, self.warned_at = state.get("minimum"), state.get("warned_at")


def first_warning(series: list[tuple[int, float | None]], factor: float = DEFAULT_FACTOR) -> int | None:
    """Replay on (step, deepest residual norm) pairs: the step of the first warning, or None."""
    warning = EarlyWarning(factor)
    for step, resid in series:
        warning.update(step, resid)
    return warning.warned_at
