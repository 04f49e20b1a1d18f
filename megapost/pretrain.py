"""``megapost-pretrain`` / ``python -m megapost.pretrain``: parse and validate the flags
(megapost.train.prepare), build the Trainer (megapost.train.build) and train."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from megapost.config.errors import ConfigError
from megapost.data import DataError
from megapost.metrics.tensor_memory import LiveTensorMemory, tensor_memory_from_env
from megapost.runtime import interrupts
from megapost.runtime.distributed import process_group_scope
from megapost.runtime.hang_report import CollectiveFailure
from megapost.runtime.launcher_report import record_for_launcher
from megapost.runtime.slurm import adopt_slurm_env
from megapost.train.build import build
from megapost.train.prepare import prepare
from megapost.utils.faults import NO_FAULTS, FaultInjector


def run(argv: Sequence[str], faults: FaultInjector = NO_FAULTS) -> dict[str, Any]:
    """Parse, validate, build and train; returns the loss history (used by tests). With
    ``MEGAPOST_TENSOR_MEMORY=1`` every tensor allocation is counted (``LiveTensorMemory``) so the first
    log line shows the measured peak beside the planner's prediction (slower; for CPU checks). A bare
    ``srun`` task takes its rank and world from SLURM's variables first (runtime/slurm.py). ``faults``:
    a test harness's (tools/fault_pretrain.py), none in production."""
    note = adopt_slurm_env()
    if note and os.environ["RANK"] == "0":
        print(f"note: {note}", flush=True)
    with tensor_memory_from_env() as tracker, process_group_scope():
        return _run(argv, tracker, faults)


def _run(argv: Sequence[str], tracker: LiveTensorMemory | None, faults: FaultInjector) -> dict[str, Any]:
    trainer = build(prepare(argv), tracker=tracker, faults=faults)  # parse + validate, then resolve + build
    try:
        return trainer.train()
    finally:
        trainer.close()


QUIET_RANK_WAIT_S = 20.0  # how long a rank other than 0 waits for the launcher to stop it


def exit_once(message: str) -> None:
    """Exit 1 with ``message``, printed once per job: rank 0 prints at once; another rank (which under
    the ``deepspeed`` launcher is stopped as soon as rank 0 exits with the same error) waits first and
    prints only if it is still running, i.e. when the error was its own."""
    record_for_launcher(message)  # torchrun's failure report names it (runtime/launcher_report.py)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(QUIET_RANK_WAIT_S)
    raise SystemExit(message)


def main(argv: Sequence[str] | None = None, faults: FaultInjector = NO_FAULTS) -> None:
    try:
        interrupts.run_guarded(lambda: run(sys.argv[1:] if argv is None else argv, faults))
    except ConfigError as e:  # bad flags or checkpoint files: one line, exit 1
        exit_once(str(e.code))
    except (DataError, FloatingPointError, CollectiveFailure) as e:  # bad data, a non-finite state, a
        # hung or dead rank: one line, exit 1
        exit_once(f"error: {e}")


if __name__ == "__main__":
    main()
