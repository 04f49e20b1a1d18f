"""Exits and the watchdog: the heartbeat that names a hung or dead rank, the injected-failure debugging
aid, and the exit conditions (--exit-interval, --exit-duration-in-mins, --exit-signal-handler).

Debugging aid: ``MEGAPOST_FAIL_RANK=<global rank>:<iteration>`` makes that rank raise a
``RuntimeError`` just before it runs that iteration (1-based), to check that a job whose rank dies
fails as a whole, within ``--distributed-timeout-minutes``, instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megapost.config.resolved import RuntimeConfig
from megapost.parallel.state import ParallelState
from megapost.runtime.hang_report import explain, is_collective_error, start_heartbeat
from megapost.runtime.interrupts import ExitConditions


def injected_failure() -> tuple[int, int] | None:
    """``(rank, iteration)`` from ``MEGAPOST_FAIL_RANK=<rank>:<iteration>``, or None when unset."""
    spec = os.environ.get("MEGAPOST_FAIL_RANK", "").strip()
    if not spec:
        return None
    try:
        rank, iteration = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"MEGAPOST_FAIL_RANK={spec!r}: expected <global rank>:<iteration>") from None
    return rank, iteration


class Watchdog:
    """Runs the loop under a heartbeat; says when to stop and when to fail on purpose."""

    def __init__(self, runtime: RuntimeConfig, timeout_minutes: float, pstate: ParallelState) -> None:
        """``runtime``: the exit flags (``exit_interval``, ``exit_duration_in_mins``,
        ``exit_signal_handler``); ``timeout_minutes``: --distributed-timeout-minutes."""
        self.pstate = pstate
        self.timeout_minutes = timeout_minutes
        self.fail_at = injected_failure()
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
        """MEGAPOST_FAIL_RANK: raise on the chosen rank before it runs ``iteration``."""
        if self.fail_at == (self.pstate.global_rank, iteration):
            raise RuntimeError(f"MEGAPOST_FAIL_RANK: rank {self.fail_at[0]} fails at iteration "
                               f"{iteration} on purpose")

    def exit_reason(self, iteration: int) -> str | None:
        return self.exits.check(iteration)
