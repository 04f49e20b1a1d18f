"""A hung rank names itself: the surviving rank's one line names the collective, its group and the rank
that stopped answering (megapost/runtime/hang_report.py), here with real gloo ranks, a real SIGSTOP and the
job's real TCPStore.  The same through the trainer and DeepSpeed's launcher: test_scale_out.py
(test_hung_rank_times_out, slow)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from megapost.runtime.hang_report import Heartbeat, explain, heartbeat_interval, is_collective_error

TIMEOUT_S = 3.0


def _rank_1_freezes_then_lags() -> list[str] | None:
    """Rank 1 first freezes (SIGSTOP) during an all_reduce, then, resumed, stays alive but away from the
    next one (at an earlier iteration); rank 0 reports both."""
    rank = dist.get_rank()
    progress = [7 if rank == 1 else 8]
    heartbeat = Heartbeat(rank, 2, lambda: progress[0], interval=0.5)
    heartbeat.store.set(f"test/pid/{rank}", str(os.getpid()))
    first = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier(first)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen like a hung process: no collective, no heartbeat
        progress[0] = 5
        dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
        time.sleep(2 * TIMEOUT_S + 1)  # alive (beating) but not in rank 0's collective
        heartbeat.stop()
        return None
    messages = []
    try:
        dist.all_reduce(torch.ones(2), group=first)
    except RuntimeError as e:
        assert is_collective_error(e)
        messages.append(str(explain(e, 0, 9, TIMEOUT_S / 60, heartbeat)))
    finally:
        os.kill(int(heartbeat.store.get("test/pid/1")), signal.SIGCONT)
    second = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
    try:
        dist.all_reduce(torch.ones(2), group=second)
    except RuntimeError as e:
        messages.append(str(explain(e, 0, 9, TIMEOUT_S / 60, heartbeat)))
    heartbeat.stop()
    return messages


@pytest.mark.integration
def test_survivor_names_the_collective_and_the_silent_rank() -> None:
    (frozen, lagging), _ = run_ranks(_rank_1_freezes_then_lags, 2, timeout=180)
    assert frozen.startswith("rank 0: all_reduce over ranks [0, 1] (called from tests/test_hang_report.py:")
    assert frozen.endswith("_rank_1_freezes_then_lags) timed out after 0.05 min (--distributed-timeout-"
                           "minutes) at iteration 9; rank(s) 1 (last heartbeat at iteration 7) stopped "
                           "answering: stopped, killed or frozen")
    assert lagging.endswith(" timed out after 0.05 min (--distributed-timeout-minutes) at iteration 9; "
                            "every rank still answers; rank(s) 1 are behind at iteration 5 (stuck elsewhere)")


def test_heartbeat_interval_scales_with_the_timeout() -> None:
    assert [heartbeat_interval(m) for m in (0.05, 0.5, 10)] == [1.0, 5.0, 30.0]


def test_only_distributed_errors_are_reworded() -> None:
    try:
        raise RuntimeError("DataLoader timed out after 5 seconds")
    except RuntimeError as e:
        assert not is_collective_error(e)
    assert is_collective_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
