"""``--collapse-guard``: roll back to a recent good state when the alarm (or the early warning) fires.

Every ``--collapse-guard-interval`` M steps, while neither event is on, the trainer's in-memory
snapshot (``PluginContext.snapshot``: module and optimizer state on the host, lr schedule, RNG, data
position) is kept with this plugin's own state; the last two are kept. On the event the older one is
restored (>= M steps before the event, before the onset the snapshot after it may already hold), a
remedy is applied, and training goes on: ``lr*F`` scales --lr and --min-lr by F, ``warmup*F``
stretches --lr-warmup-iters by F (``warmup`` = ``warmup*2``; a warmup already over stays over),
``rewarm*F/W`` (alias ``warmup-restart*F/W``) re-warms from the rollback point: the schedule's lr times a
ramp from F to 1 over the next W steps (``rewarm`` = ``rewarm*0.1/W`` with W = --lr-warmup-iters, or 50
without warmup; each further rollback doubles W), ``skip`` keeps the data position (the window since
the snapshot is not trained on again), ``law`` re-warms like ``rewarm`` to the peak the collapse law
(``--collapse-guard-law``, else the planner's fit) predicts safe for this run's own factors: P(collapse)
per seed ``LAW_SAFE_P``, halved again when the run is already below it. A remedy that cannot change the
run (``warmup*F`` without a warmup) is refused at start. After ``--collapse-guard-retries`` rollbacks the
next event stops the run with one line. The counters and remedy scales are plugin state (checkpointed).
Exact for ZeRO-0 in fp32 without pipeline parallelism; other layouts are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any

from megapost.plugin_api import CollapseLaw, ConfigError, PluginContext, RunInfo

from .config import CollapseConfig

REMEDY = re.compile(r"^(?:(lr|warmup)\*([0-9.eE+-]+)|(warmup)|(skip)|(law)|"
                    r"(?:rewarm|warmup-restart)(?:\*([0-9.eE+-]+)(?:/([0-9]+))?)?)$")
REWARM_FRACTION, REWARM_STEPS_NO_WARMUP = 0.1, 50
LAW_SAFE_P = 0.05  # the law remedy's peak: predictive P(collapse) per seed


def add_guard_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--collapse-guard", action="store_true",
                   help="roll back to an in-memory snapshot when the alarm/early warning fires (guard.py)")
    g.add_argument("--collapse-guard-on", choices=["alarm", "early"], default="alarm",
                   help="the event that triggers a rollback ('early' needs --collapse-early-warning)")
    g.add_argument("--collapse-guard-remedy", default="lr*0.5", metavar="R",
                   help="lr*F | warmup*F | warmup | rewarm[*F[/W]] (warmup-restart) | law | skip")
    g.add_argument("--collapse-guard-law", metavar="FILE", default=None,
                   help="the law remedy's fit (megapost-law boundary; default: the planner's)")
    g.add_argument("--collapse-guard-retries", type=int, default=2, metavar="N",
                   help="rollbacks before the run stops")
    g.add_argument("--collapse-guard-interval", type=int, default=50, metavar="M",
                   help="snapshot every M steps")


@dataclass
class Remedy:
    kind: str  # "lr", "warmup", "rewarm", "law" or "skip"
    factor: float = 1.0
    steps: int = 0  # rewarm: ramp length (0: --lr-warmup-iters, or REWARM_STEPS_NO_WARMUP)

    @classmethod
    def parse(cls, text: str) -> Remedy:
        m = REMEDY.match(text.replace(" ", ""))
        try:
            if m and m.group(1):
                return cls(m.group(1), float(m.group(2)))
        except ValueError:
            m = None
        if m and m.group(3):
            return cls("warmup", 2.0)
        if m and m.group(4):
            return cls("skip")
        if m and m.group(5):
            return cls("law", REWARM_FRACTION)
        fraction = 0.0
        with contextlib.suppress(ValueError):
            fraction = float(m.group(6)) if m and m.group(6) else REWARM_FRACTION
        if m and 0 < fraction <= 1:
            return cls("rewarm", fraction, int(m.group(7) or 0))
        raise ConfigError(f"--collapse-guard-remedy {text!r}: expected lr*F, warmup*F, warmup, "
                          "rewarm[*F[/W]] with 0 < F <= 1, law, or skip")


def check_guard_args(flags: CollapseConfig, run: RunInfo, laws: CollapseLaw) -> None:
    if not flags.collapse_guard:
        return
    if run.zero_stage != 0 or run.bf16 or run.pipeline_model_parallel_size > 1:
        raise ConfigError("--collapse-guard: in-memory snapshots are exact only for --zero-stage 0 in fp32 "
                          "without pipeline parallelism; drop --zero-stage/--bf16/"
                          "--pipeline-model-parallel-size or the guard")
    if flags.collapse_guard_on == "early" and not flags.collapse_early_warning:
        raise ConfigError("--collapse-guard-on early needs --collapse-early-warning")
    if flags.collapse_guard_interval < 1 or flags.collapse_guard_retries < 0:
        raise ConfigError("--collapse-guard-interval must be >= 1 and --collapse-guard-retries >= 0")
    remedy = Remedy.parse(flags.collapse_guard_remedy)
    if remedy.kind == "warmup" and not run.lr_warmup_iters:
        raise ConfigError(f"--collapse-guard-remedy {flags.collapse_guard_remedy}: stretches "
                          "--lr-warmup-iters, which is 0 here, so it cannot change the run; use rewarm or "
                          "law (re-warm from the rollback point)")
    if remedy.kind == "law":
        guard_law(flags, run, laws)


def guard_law(flags: CollapseConfig, run: RunInfo, laws: CollapseLaw) -> tuple[Any, str]:
    """The law remedy's fit (one-line error when there is none or it is for another placement)."""
    law, source = laws.load(flags.collapse_guard_law, "--collapse-guard-law")
    if law is None:
        raise ConfigError(f"--collapse-guard-remedy law: {source}")
    if law.placement != run.norm_position:
        raise ConfigError(f"--collapse-guard-remedy law: {source} was fitted for --norm-position "
                          f"{law.placement}, not {run.norm_position}")
    return law, source


class Guard:
    def __init__(self, flags: CollapseConfig, run: RunInfo, laws: CollapseLaw) -> None:
        self.flags, self.run, self.on = flags, run, flags.collapse_guard_on
        self.remedy = Remedy.parse(flags.collapse_guard_remedy)
        self.law_note, self.safe_lr = "", None
        if self.remedy.kind == "law":
            law, source = guard_law(flags, run, laws)
            pred = law.predict(laws.run_factors())
            self.safe_lr = pred.lr_at(LAW_SAFE_P, law.sigma)
            self.law_note = (f" (the law's P(collapse) = {LAW_SAFE_P:g} peak here: lr* {pred.lr_star:.3g} "
                             f"[{pred.interval[0]:.3g}, {pred.interval[1]:.3g}], {source}"
                             + ("; extrapolated" if pred.extrapolated or pred.not_modelled else "") + ")")
        self.interval, self.retries = flags.collapse_guard_interval, flags.collapse_guard_retries
        self.rollbacks = 0
        self.lr_scale = self.warmup_scale = 1.0
        self.rewarm: tuple[int, int, float] | None = None  # (from step, steps, fraction) of a rewarm
        self.requested: tuple | None = None  # the scales last asked of the schedule
        self.snapshots: list[dict[str, Any]] = []

    def _request_schedule(self, ctx: PluginContext) -> None:
        """Ask the trainer to scale the lr schedule by the remedy's scales (applied before the next step)."""
        if self.requested == (self.lr_scale, self.warmup_scale, self.rewarm):
            return
        ctx.scale_lr(lr=self.lr_scale, warmup=self.warmup_scale, rewarm=self.rewarm)
        self.requested = (self.lr_scale, self.warmup_scale, self.rewarm)

    def after_iteration(self, iteration: int, ctx: PluginContext, event: str | None, healthy: bool,
                        plugin_state: Any) -> dict[str, Any] | None:
        """Snapshot (when ``healthy``: neither event on) or roll back on ``event``; returns the rollback's
        record (None otherwise). ``plugin_state`` is the plugin's ``(state_dict, load_state_dict)``."""
        self._request_schedule(ctx)
        if event is None:
            if healthy and (not self.snapshots or iteration % self.interval == 0):
                self.snapshots = [*self.snapshots[-1:], {"trainer": ctx.snapshot(),
                                                         "plugin": copy.deepcopy(plugin_state[0]())}]
            return None
        if self.rollbacks >= self.retries:
            raise SystemExit(f"[collapse] guard: {event} at step {iteration} after {self.rollbacks} "
                             f"rollback(s) (--collapse-guard-retries {self.retries}); stopping")
        snap = self.snapshots[0]
        self.snapshots = [snap]
        self.rollbacks += 1
        if self.remedy.kind == "lr":
            self.lr_scale *= self.remedy.factor
        elif self.remedy.kind == "warmup":
            self.warmup_scale *= self.remedy.factor
        elif self.remedy.kind == "law" and self.safe_lr is not None:
            now = self.run.lr * self.lr_scale
            self.lr_scale *= self.safe_lr / now if now > self.safe_lr else 0.5
        counters = self.state_dict()
        ctx.restore(snap["trainer"], skip_data=self.remedy.kind == "skip")
        plugin_state[1](copy.deepcopy(snap["plugin"]))
        self.load_state_dict(counters)
        back = snap["trainer"]["iteration"]
        if self.remedy.kind in ("rewarm", "law"):
            steps = self.remedy.steps or self.run.lr_warmup_iters or REWARM_STEPS_NO_WARMUP
            steps *= 2 ** (self.rollbacks - 1)  # the same ramp again would replay the same failure
            self.rewarm = (back, steps, self.remedy.factor)
        self._request_schedule(ctx)
        a, remedy = self.run, self.flags.collapse_guard_remedy
        lr, warmup = a.lr * self.lr_scale, round(a.lr_warmup_iters * self.warmup_scale)  # as the schedule
        return {"event": event, "step": iteration, "to_step": back, "rollback": self.rollbacks,
                "remedy": remedy, "lr": lr, "warmup": warmup,
                "line": (f"[collapse] guard: {event} at step {iteration}; rolled back to step {back} "
                         f"(rollback {self.rollbacks}/{self.retries}), remedy {remedy}: peak lr "
                         f"{lr:.3g}, warmup {warmup}"
                         + (", data window skipped" if self.remedy.kind == "skip" else "")
                         + (f", lr re-warmed from x{self.rewarm[2]:g} over {self.rewarm[1]} steps"
                            if self.remedy.kind in ("rewarm", "law") else "") + self.law_note)}

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale, "warmup_scale": self.warmup_scale,
                "rewarm": None if self.rewarm is None else list(self.rewarm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state["rollbacks"])
        self.lr_scale, self.warmup_scale = float(state["lr_scale"]), float(state["warmup_scale"])
        rewarm = state.get("rewarm")
        self.rewarm = None if rewarm is None else (int(rewarm[0]), int(rewarm[1]), float(rewarm[2]))
