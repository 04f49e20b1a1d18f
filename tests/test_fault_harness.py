"""The fault harness (tools/fault_pretrain.py) on fakes: its flags become a FaultInjector that fails,
pauses or refuses exactly where asked and nowhere else; the product's base class does nothing."""

from __future__ import annotations

import errno
import sys

import pytest
from launch_utils import REPO

from megapost.utils.faults import NO_FAULTS

sys.path.insert(0, str(REPO / "tools"))
from fault_pretrain import parse_kill_points, split_argv  # noqa: E402


def test_production_faults_do_nothing() -> None:
    NO_FAULTS.before_step(0, 1)
    NO_FAULTS.point("eval")
    NO_FAULTS.save_file_half_written(2, background=True)
    NO_FAULTS.snapshot_half_taken(2)
    NO_FAULTS.install(None, None)


def test_flags_split_from_the_run_flags() -> None:
    faults, rest = split_argv(["--train-iters", "4", "--slow-save", "4:300", "--lr", "1e-3"], rank=0)
    assert rest == ["--train-iters", "4", "--lr", "1e-3"] and faults.slow_save == (4, 300.0)
    assert parse_kill_points("forward:7:0,eval:1:1", 1) == {"eval": 1}
    with pytest.raises(ValueError, match="unknown phase 'nope'"):
        parse_kill_points("nope:1:0", 0)


def test_slow_save_and_snapshot_pause_only_their_iteration() -> None:
    slept: list[float] = []
    faults, _ = split_argv(["--slow-save", "4:3", "--slow-snapshot", "2:5"], rank=1)
    faults.sleep = slept.append
    faults.save_file_half_written(2, background=False)
    faults.snapshot_half_taken(4)
    assert slept == []
    faults.save_file_half_written(4, background=True)
    faults.snapshot_half_taken(2)
    assert slept == [3.0, 5.0]


def test_enospc_fails_that_ranks_first_background_write_once() -> None:
    other, _ = split_argv(["--enospc", "1"], rank=0)
    other.save_file_half_written(2, background=True)  # another rank: nothing
    faults, _ = split_argv(["--enospc", "1"], rank=1)
    faults.save_file_half_written(2, background=False)  # a synchronous save: nothing
    with pytest.raises(OSError) as e:
        faults.save_file_half_written(2, background=True)
    assert e.value.errno == errno.ENOSPC
    faults.save_file_half_written(4, background=True)  # once


def test_fail_rank_raises_before_its_iteration_only() -> None:
    faults, _ = split_argv(["--fail-rank", "1:3"], rank=1)
    faults.before_step(1, 2)
    faults.before_step(0, 3)
    with pytest.raises(RuntimeError, match="rank 1 fails at iteration 3"):
        faults.before_step(1, 3)


def test_a_kill_point_fires_at_its_planned_pass(monkeypatch) -> None:
    import fault_pretrain

    killed: list[int] = []
    monkeypatch.setattr(fault_pretrain.os, "kill", lambda pid, sig: killed.append(sig))
    faults, _ = split_argv(["--kill-point", "async_write:2:0"], rank=0)
    faults.save_file_half_written(2, background=False)  # sync_save: not planned
    faults.save_file_half_written(2, background=True)
    assert killed == []
    faults.save_file_half_written(4, background=True)
    assert killed == [fault_pretrain.signal.SIGKILL]
