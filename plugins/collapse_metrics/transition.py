"""Transition detector: the measured step where the last layer's t_sim and the loss rise together.

Each series v (t_sim of X^H, the head input, i.e. the last layer's output; and the training loss)
keeps an exponential moving mean m and variance s^2 (decay beta, West's update, updated after the
test). At a measured step the deviation from the *previous* state is

    z_v = (v - m_v) / sqrt(s_v^2 + floor_v^2)

and the step is a transition when, after ``warmup`` measured steps,

    z_tsim >= z_min  and  z_loss >= z_min                        (both rise sharply vs. their noise)
    v_tsim - m_tsim >= min_tsim_rise                              (absolute t_sim jump)
    v_loss - m_loss >= min_loss_rise * |m_loss|                   (relative loss jump)

Only the first step of a run of consecutive qualifying steps is flagged (re-armed when the
condition fails), so one transition gives one alert. ``floor`` keeps z finite on a flat series
(floor_tsim = min_tsim_rise / z_min, floor_loss = min_loss_rise * |m_loss| / z_min, i.e. a jump of
exactly the minimum size scores z_min on a noiseless series). Loss normally falls, so its z is
negative outside instabilities; t_sim may creep up slowly without tripping the detector.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TransitionConfig:
    beta: float = 0.9
    z_min: float = 4.0
    min_tsim_rise: float = 0.05
    min_loss_rise: float = 0.02
    warmup: int = 10


@dataclass
class _Ema:
    mean: float = math.nan
    var: float = 0.0

    def z(self, value: float, floor: float) -> float:
        return (value - self.mean) / math.sqrt(self.var + floor * floor)

    def update(self, value: float, beta: float) -> None:
        if math.isnan(self.mean):
            self.mean = value
            return
        diff = value - self.mean
        incr = (1.0 - beta) * diff
        self.mean += incr
        self.var = beta * (self.var + diff * incr)


@dataclass
class TransitionEvent:
    step: int
    tsim: float
    tsim_mean: float
    z_tsim: float
    loss: float
    loss_mean: float
    z_loss: float

    def line(self) -> str:
        return (f"[collapse] transition at step {self.step}: t_sim(X^H) {self.tsim_mean:.3f} -> "
                f"{self.tsim:.3f} (z={self.z_tsim:.1f}), loss {self.loss_mean:.3f} -> {self.loss:.3f} "
                f"(z={self.z_loss:.1f})")


@dataclass
class TransitionDetector:
    config: TransitionConfig = field(default_factory=TransitionConfig)
    tsim: _Ema = field(default_factory=_Ema)
    loss: _Ema = field(default_factory=_Ema)
    seen: int = 0
    armed: bool = True

    def update(self, step: int, tsim: float | None, loss: float | None) -> TransitionEvent | None:
        """Feed one measured step; returns the event when this step is flagged. Missing or non-finite
        values are skipped (the state is left unchanged)."""
        if tsim is None or loss is None or not (math.isfinite(tsim) and math.isfinite(loss)):
            return None
        cfg = self.config
        event = None
        if self.seen >= max(cfg.warmup, 1):
            z_t = self.tsim.z(tsim, cfg.min_tsim_rise / cfg.z_min)
            loss_rise = cfg.min_loss_rise * abs(self.loss.mean)
            z_l = self.loss.z(loss, max(loss_rise, 1e-12) / cfg.z_min)
            rising = (z_t >= cfg.z_min and z_l >= cfg.z_min and tsim - self.tsim.mean >= cfg.min_tsim_rise
                      and loss - self.loss.mean >= loss_rise)
            if rising and self.armed:
                event = TransitionEvent(step, tsim, self.tsim.mean, z_t, loss, self.loss.mean, z_l)
            self.armed = not rising
        self.tsim.update(tsim, cfg.beta)
        self.loss.update(loss, cfg.beta)
        self.seen += 1
        return event

    def state_dict(self) -> dict[str, Any]:
        return {"tsim": asdict(self.tsim), "loss": asdict(self.loss), "seen": self.seen, "armed": self.armed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tsim, self.loss = _Ema(**state["tsim"]), _Ema(**state["loss"])
        self.seen, self.armed = int(state["seen"]), bool(state["armed"])
