"""The seam through which a test harness injects faults into a run: the harness passes a
``FaultInjector`` subclass to ``megapost.pretrain.main(argv, faults=...)`` (``tools/fault_pretrain.py``:
a rank that fails, kill points, slow or failing checkpoint writes); every ordinary run gets this base
class, whose hooks do nothing. No product module reads a test-only environment variable for it."""

from __future__ import annotations

from typing import Any


class FaultInjector:
    """No faults (production). A harness overrides what it needs."""

    def before_step(self, rank: int, iteration: int) -> None:
        """Called by every rank (global ``rank``) just before it runs ``iteration`` (1-based)."""

    def point(self, phase: str) -> None:
        """Called as this process passes a named point of a run: ``eval`` (between two evaluation
        micro-batches), ``index_build`` (between a dataset index's document and sample index)."""

    def install(self, module: Any, optimizer: Any) -> None:
        """Called once the model and the torch optimizer are built: hooks for the ``forward``,
        ``backward`` and ``optimizer_step`` points, where the harness wants them."""

    def save_file_half_written(self, iteration: int, background: bool) -> None:
        """Called with a checkpoint file of ``iteration`` half written (its first tensor out), in the
        training thread or (``background``) the ``--async-save`` writer; may raise an ``OSError``."""

    def snapshot_half_taken(self, iteration: int) -> None:
        """Called by the ``--async-save`` writer with the first tensor of ``iteration``'s host snapshot
        copied (the next optimizer step waits for the snapshot)."""


NO_FAULTS = FaultInjector()
