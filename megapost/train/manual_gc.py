"""Megatron's ``--manual-gc``: Python's automatic collector off, a full collection at start and every
``--manual-gc-interval`` iterations (0: never again), so all ranks pause for gc at the same step. What
survives the first collection (the model, the engine, the data structures of the run) is frozen out of
later collections (``gc.freeze``), so each one scans only what the steps allocated. On by default on a
CUDA device (megapost.config.megatron_habits)."""

from __future__ import annotations

import gc

from megapost.config.resolved import RuntimeConfig
from megapost.plugin_api import Plugin


class ManualGC(Plugin):
    """A built-in plugin (no context: it needs only its interval)."""

    name = "manual_gc"

    def __init__(self, interval: int) -> None:
        self.ctx = None
        self.interval = interval
        gc.disable()
        gc.collect()
        gc.freeze()

    def after_iteration(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        gc.unfreeze()
        gc.enable()


def manual_gc_plugins(runtime: RuntimeConfig) -> list[Plugin]:
    """``[ManualGC]`` under --manual-gc, else nothing."""
    return [ManualGC(runtime.manual_gc_interval)] if runtime.manual_gc else []
