"""Name the collective and the rank(s) behind a distributed failure, in one line.

When a collective times out (a rank hung) or a peer's connection drops (a rank died), torch raises on
the surviving ranks with a message that names neither.  ``explain`` turns that exception into a
``CollectiveFailure`` naming the collective in flight (from the traceback: the ``torch.distributed``
call and its ``group``) and the ranks that stopped answering.  The latter comes from a ``Heartbeat``:
a daemon thread per rank that writes ``<beat> <iteration>`` to the job's rendezvous store every few
seconds; nothing is added to the training step itself.  After a failure the survivor reads every
rank's heartbeat twice, 1.5 intervals apart: a rank whose beat did not advance is stopped, dead or
hung with its process frozen; one that beats but lags in iterations is stuck elsewhere.

(With NCCL, torch's watchdog usually aborts a timed-out process itself, logging the op type and
sequence number; the heartbeat report then comes only from ranks that raise.)
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

import torch.distributed as dist

_KEY = "megapost/heartbeat/{rank}"
_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_GONE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_WRAPPERS = {"wrapper", "_exception_logger", "_time_logger", "inner", "_wrapper"}


class CollectiveFailure(RuntimeError):
    """A one-line account of which collective failed and which ranks did not answer."""


def heartbeat_interval(timeout_minutes: float) -> float:
    """Seconds between beats: a sixth of the collective timeout, within [1, 30]."""
    return min(30.0, max(1.0, timeout_minutes * 60 / 6))


class Heartbeat:
    """Publishes this rank's liveness and progress to the job's rendezvous store."""

    def __init__(self, rank: int, world_size: int, progress: Callable[[], int], interval: float) -> None:
        self.rank, self.world_size, self.progress, self.interval = rank, world_size, progress, interval
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.where = f"{host}:{port}"
        self.store = dist.TCPStore(host, port, world_size=None, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=max(5.0, 2 * interval)))
        self._beats = 0
        self._stop = threading.Event()
        self._beat()  # the key exists before training starts
        self._thread = threading.Thread(target=self._run, name="megapost-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(_KEY.format(rank=self.rank), f"{self._beats} {self.progress()}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store went away; the main thread will hear of it
                return

    def stop(self) -> None:
        self._stop.set()

    def read(self) -> dict[int, tuple[int, int]]:
        """``{rank: (beat, iteration)}`` of the ranks that have beaten at least once."""
        present = [r for r in range(self.world_size) if self.store.check([_KEY.format(rank=r)])]
        values = self.store.multi_get([_KEY.format(rank=r) for r in present]) if present else []
        out = {}
        for rank, raw in zip(present, values, strict=True):
            beat, iteration = raw.decode().split()
            out[rank] = (int(beat), int(iteration))
        return out

    def silent_ranks(self) -> str:
        """``rank(s) 1 (last heartbeat at iteration 2) stopped answering``, ``every rank still
        answers``, or why that cannot be told."""
        try:
            first = self.read()
            time.sleep(1.5 * self.interval)
            second = self.read()
        except Exception:  # noqa: BLE001 - the store is in rank 0's process (or the launcher's)
            return (f"the rendezvous store at {self.where} does not answer, so the process hosting it "
                    "(usually rank 0) is the one that stopped")
        me = second.get(self.rank, (0, 0))[1]
        silent = [r for r in range(self.world_size)
                  if r != self.rank and (r not in second or second[r][0] == first.get(r, (None,))[0])]
        if silent:
            described = ", ".join(f"{r} (last heartbeat at iteration {second[r][1]})" if r in second
                                  else f"{r} (no heartbeat ever)" for r in silent[:8])
            if len(silent) > 8:
                described += f" and {len(silent) - 8} more"
            return f"rank(s) {described} stopped answering: stopped, killed or frozen"
        behind = [r for r in second if second[r][1] < me]
        if behind:
            return (f"every rank still answers; rank(s) {', '.join(map(str, behind))} are behind at "
                    f"iteration {min(second[r][1] for r in behind)} (stuck elsewhere)")
        return "every rank still answers"


def start_heartbeat(rank: int, world_size: int, progress: Callable[[], int],
                    timeout_minutes: float) -> Heartbeat | None:
    """A Heartbeat for a multi-rank job whose rendezvous store is MASTER_ADDR:MASTER_PORT, else None."""
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return Heartbeat(rank, world_size, progress, heartbeat_interval(timeout_minutes))
    except Exception:  # noqa: BLE001 - another rendezvous (file://, ...): no report, training goes on
        return None


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def collective_in_flight(exc: BaseException) -> str:
    """``all_reduce over ranks [0, 1]``, from the innermost ``torch.distributed`` call in the traceback."""
    frames = _frames(exc.__traceback__)
    calls = [f for f in frames if f.f_code.co_filename.endswith("distributed_c10d.py")
             and f.f_code.co_name not in _WRAPPERS]
    ours = [f for f in frames if "torch" + os.sep not in f.f_code.co_filename]
    caller = ""
    if ours:
        code = ours[-1].f_code
        parts = code.co_filename.split(os.sep)
        caller = f" (called from {os.sep.join(parts[-2:])}:{ours[-1].f_lineno} {code.co_name})"
    if not calls:
        return f"a collective{caller}"
    frame = calls[-1]
    group = frame.f_locals.get("group")
    try:
        ranks = (dist.get_process_group_ranks(group) if group is not None
                 else list(range(dist.get_world_size())))
        over = f" over ranks {ranks}" if len(ranks) <= 16 else f" over a group of {len(ranks)} ranks"
    except Exception:  # noqa: BLE001 - group already torn down
        over = ""
    return f"{frame.f_code.co_name}{over}{caller}"


def is_collective_error(exc: BaseException) -> bool:
    """A timeout or lost peer raised by torch.distributed (not, say, a data loader's timeout)."""
    text = str(exc).lower()
    if not any(m in text for m in _TIMEOUT_MARKERS + _PEER_GONE_MARKERS):
        return False
    in_c10d = any(f.f_code.co_filename.endswith("distributed_c10d.py") for f in _frames(exc.__traceback__))
    return in_c10d or any(k in text for k in ("gloo", "nccl", "c10d"))


def explain(exc: BaseException, rank: int, iteration: int, timeout_minutes: float,
            heartbeat: Heartbeat | None) -> CollectiveFailure:
    """The one-line CollectiveFailure for a collective's exception on this rank."""
    text = str(exc).lower()
    what = collective_in_flight(exc)
    if any(m in text for m in _TIMEOUT_MARKERS):
        how = f"timed out after {timeout_minutes:g} min (--distributed-timeout-minutes)"
    else:
        how = "failed: a peer closed its connection (that rank died or was killed)"
    who = heartbeat.silent_ranks() if heartbeat is not None else "no heartbeat to tell which rank"
    return CollectiveFailure(f"rank {rank}: {what} {how} at iteration {iteration}; {who}")
