"""Exits and the watchdog: the heartbeat that names a hung or dead rank, the exit conditions
(--exit-interval, --exit-duration-in-mins, --exit-signal-handler), and the point where a harness's
``FaultInjector`` may fail a rank before a step (tools/fault_pretrain.py: a job whose rank dies must
fail as a whole, within ``--distributed-timeout-minutes``, instead of hanging).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megapost.config.resolved import RuntimeConfig
from megapost.parallel.state import ParallelState
from megapost.runtime.hang_report import explain, is_collective_error, start_heartbeat
from megapost.runtime.interrupts import ExitConditions
from megapost.utils.faults import NO_FAULTS, FaultInjector


class Watchdog:
    """Runs the loop under a heartbeat; says when to stop and when to fail on purpose."""

    def __init__(self, runtime: RuntimeConfig, timeout_minutes: float, pstate: ParallelState,
                 faults: FaultInjector = NO_FAULTS) -> None:
        """``runtime``: the exit flags (``exit_interval``, ``exit_duration_in_mins``,
        ``exit_signal_handler``); ``timeout_minutes``: --distributed-timeout-minutes; ``faults``: a
        harness's (none in production)."""
        self.pstate, self.faults = pstate, faults
        self.timeout_minutes = timeout_minutes
        self.exits = ExitConditions(runtime.exit_interval, runtime.exit_duration_in_mins,
                                    runtime.exit_signal_handler)

    def run(self, loop: Callable[[], Any], iteration: Callable[[], int]) -> Any:
        """``loop()``; a collective that times out or loses a peer ends it with a CollectiveFailure
        naming the collective and the ranks that stopped answering (hang_report)."""
        rank = self.pstate.global_rank
        heartbeat = start_heartbeat(rank, self.pstate.world_size, iteration, self.timeout_minutes)
        try:
            return loop()
        except RuntimeError as e:
            if heartbeat is None or not is_collective_error(e):
                raise
            raise explain(e, rank, iteration() + 1, self.timeout_minutes, heartbeat) from None
        finally:
            if heartbeat is not None:
                heartbeat.stop()

    def before_step(self, iteration: int) -> None:
        """Before this rank runs ``iteration``: the harness's fault, if any."""
        self.faults.before_step(self.pstate.global_rank, iteration)

    def exit_reason(self, iteration: int) -> str | None:
        return self.exits.check(iteration)
