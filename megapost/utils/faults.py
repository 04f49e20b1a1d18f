"""The seam through which a test harness injects faults into a run: the harness passes a
``FaultInjector`` subclass to ``megapost.pretrain.main(argv, faults=...)`` (``tests/fault_pretrain.py``);
every ordinary run gets this base class, which injects nothing. No product module reads a test-only
environment variable for it."""

from __future__ import annotations


class FaultInjector:
    """No faults (production). A harness overrides what it needs."""

    def before_step(self, rank: int, iteration: int) -> None:
        """Called by every rank (global ``rank``) just before it runs ``iteration`` (1-based)."""


NO_FAULTS = FaultInjector()
