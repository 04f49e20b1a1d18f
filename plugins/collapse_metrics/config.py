"""The plugin's own typed config: one field per flag its ``add_arguments`` registers (the flags' dests),
built by megapost from the parsed flags (``Plugin.config_class``) and recorded in the run's args.json under
``plugins.collapse_metrics``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CollapseConfig:
    collapse_interval: int
    collapse_layers: str
    collapse_at_init: bool
    collapse_image_interval: int | None
    collapse_transition_beta: float
    collapse_transition_z: float
    collapse_transition_min_tsim_rise: float
    collapse_transition_min_loss_rise: float
    collapse_transition_warmup: int
    collapse_state_tsim: float
    collapse_state_grad_ratio: float
    collapse_early_warning: bool
    collapse_early_warning_factor: float
    collapse_guard: bool  # guard.py
    collapse_guard_on: str
    collapse_guard_remedy: str
    collapse_guard_law: str | None
    collapse_guard_retries: int
    collapse_guard_interval: int
    collapse_autopsy: int  # autopsy.py
    collapse_autopsy_on: str
    collapse_autopsy_after: int | None
    collapse_autopsy_hessian_every: int
    collapse_autopsy_power_iters: int
