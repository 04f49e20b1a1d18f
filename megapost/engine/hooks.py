"""What megapost adds to a DeepSpeed engine (through ``megapost.ds_adapter.engine``): a callback just
before the optimizer step, the sync-free steps that skip a non-finite gradient (counted by a
``SkipCounter``, the lr schedule counting on the device), and no gradient "all-reduce" over a
data-parallel group of one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megapost.config.errors import ConfigError
from megapost.ds_adapter import engine as ds_engine
from megapost.ds_adapter import selftest
from megapost.engine.skips import SkipCounter


def install(engine: Any, before_step: Callable[[], None], dp_size: int | None = None,
            skip_limit: int = 0) -> SkipCounter:
    """Install the hooks; with ``dp_size`` 1, skip the engine's data-parallel gradient reduction. Returns
    the counter of skipped steps (``skip_limit``: --max-consecutive-skipped-iterations). The adapter's
    self-test runs first (one line if DeepSpeed changed)."""
    problem = selftest.run(engine)
    if problem:
        raise ConfigError(problem)
    skips = SkipCounter(engine.device, skip_limit)
    skips.mode = ds_engine.install(engine, before_step, skips.record)
    skips.skipped_by_deepspeed = lambda: ds_engine.skipped_by_deepspeed(engine)
    scheduler = getattr(engine, "lr_scheduler", None)
    if skips.mode == "device" and hasattr(scheduler, "count_on_device"):
        scheduler.count_on_device(skips.last)
    if dp_size == 1:
        ds_engine.skip_single_rank_reduction(engine)
    return skips


skip_single_rank_reduction = ds_engine.skip_single_rank_reduction
