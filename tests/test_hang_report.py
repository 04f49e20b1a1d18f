"""A hung rank names itself: the surviving rank's one line names the collective, its group and the rank
that stopped answering (megapost/hang_report.py), here with real gloo ranks, a real SIGSTOP and the
job's real TCPStore.  The same through the trainer and DeepSpeed's launcher: test_scale_out.py
(test_hung_rank_times_out, slow)."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import run_ranks

from megapost.hang_report import Heartbeat, explain, heartbeat_interval, is_collective_error

TIMEOUT_S = 3.0


def _rank_1_freezes() -> str | None:
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
    heartbeat = Heartbeat(rank, 2, lambda: 7, interval=0.5)
    heartbeat.store.set(f"test/pid/{rank}", str(os.getpid()))
    dist.barrier(group)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen like a hung process: no collective, no heartbeat
        heartbeat.stop()
        return None
    try:
        dist.all_reduce(torch.ones(2), group=group)
        message = "the all_reduce completed"
    except RuntimeError as e:
        assert is_collective_error(e)
        message = str(explain(e, 0, 8, TIMEOUT_S / 60, heartbeat))
    finally:
        os.kill(int(heartbeat.store.get("test/pid/1")), signal.SIGCONT)
    heartbeat.stop()
    return message


def test_survivor_names_the_collective_and_the_frozen_rank() -> None:
    message, _ = run_ranks(_rank_1_freezes, 2, timeout=180)
    assert message.startswith("rank 0: all_reduce over ranks [0, 1] (called from tests/test_hang_report.py:")
    assert message.endswith("_rank_1_freezes) timed out after 0.05 min (--distributed-timeout-minutes) at "
                            "iteration 8; rank(s) 1 (last heartbeat at iteration 7) stopped answering: "
                            "stopped, killed or frozen")


def test_heartbeat_interval_scales_with_the_timeout() -> None:
    assert [heartbeat_interval(m) for m in (0.05, 0.5, 10)] == [1.0, 5.0, 30.0]
