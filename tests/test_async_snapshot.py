"""The async save's host snapshot (checkpoint/snapshot.py Snapshot / HostPool): the writer can never
skip the device-copy event, whatever the thread interleaving; it sets its rank's CUDA device first;
one flat host buffer per rank, sized exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from megapost.checkpoint.snapshot import HostPool
from megapost.checkpoint.writer import RankFiles


class _Event:
    """Stands in for the torch.cuda.Event of the side-stream copies (no GPU here): records who waited."""

    def __init__(self) -> None:
        self.synchronized = threading.Event()

    def synchronize(self) -> None:
        self.synchronized.set()


class _Stream:
    def wait_event(self, _event: object) -> None:
        pass


def test_writer_waits_for_the_copy_event_even_when_training_waits_first(monkeypatch) -> None:
    """Force the switch: right after the writer marks the host copy taken, the training thread runs
    wait() to completion before the writer goes on. The writer must still synchronize the event."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    snap = HostPool().snapshot(RankFiles())
    event, trained = _Event(), threading.Event()
    snap._event = event  # as if device tensors' copies were queued on the side stream
    taken = snap._taken

    class SwitchAfterSet(threading.Event):
        def set(self) -> None:
            taken.set()
            assert trained.wait(10), "the training thread did not run wait()"

        def wait(self, timeout: float | None = None) -> bool:
            return taken.wait(timeout)

    snap._taken = SwitchAfterSet()
    writer = threading.Thread(target=snap.take)
    writer.start()
    snap.wait()  # the training thread: returns as soon as the writer marks the copy taken
    trained.set()
    writer.join(10)
    assert event.synchronized.is_set(), "the writer skipped the copy event: it may write in-flight buffers"


def test_writer_sets_the_ranks_device_before_any_cuda_call(monkeypatch) -> None:
    calls: list[tuple[str, object, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", d, threading.get_ident())))
    snap = HostPool().snapshot(RankFiles())
    snap.device = torch.device("cuda", 3)  # as if this rank's tensors live on GPU 3

    class Ev:
        def synchronize(self) -> None:
            calls.append(("synchronize", None, threading.get_ident()))

    snap._event = Ev()
    writer = threading.Thread(target=snap.take)
    writer.start()
    writer.join(10)
    assert calls == [("set_device", torch.device("cuda", 3), writer.ident),
                     ("synchronize", None, writer.ident)]


def test_one_flat_host_buffer_per_rank_sized_exactly_and_reused() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)
    files = RankFiles([("x.safetensors", [("a", a), ("b", b)], {}),
                               ("y.safetensors", [("c", torch.tensor(2.5)), ("d", torch.zeros(0))], {})])
    pool = HostPool()
    snap = pool.snapshot(files)
    assert pool.nbytes == 64 + 64 + 64 + 0  # 60, 14 and 4 bytes, each rounded up to 64; the empty one 0
    bufs = [t for _, entries, _ in snap.files.files for _, t in entries]
    base = bufs[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in bufs)  # one allocation
    assert [t.data_ptr() - base for t in bufs[:3]] == [0, 64, 128]
    snap.take()
    snap.wait()
    assert torch.equal(bufs[0], a) and torch.equal(bufs[1], b) and bufs[2].item() == 2.5
    again = pool.snapshot(files)
    assert again.files.files[0][1][0][1].untyped_storage().data_ptr() == base  # reused, not reallocated


@pytest.mark.slow  # a real trainer, two steps and an async save: ~20 s on 2 busy cores
def test_async_save_buffer_is_allocated_before_the_first_save_and_reused_by_it(tmp_path) -> None:
    import argparse
    import sys

    from launch_utils import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_common import build_trainer

    from megapost.runtime.distributed import process_group_scope

    b = argparse.Namespace(layers=1, hidden=32, seq=16, micro=2, accum=1, vocab=64)
    with process_group_scope():
        trainer, _, _ = build_trainer(b, ["--save", str(tmp_path), "--save-interval", "0", "--async-save"])
        pool = trainer.checkpoints.saver.pool
        trainer.train_step(1)
        assert pool.nbytes == 0  # no moments yet: nothing to size
        trainer.train_step(2)
        reserved = pool._flat
        assert reserved is not None and pool.nbytes > 0
        trainer.save()
        trainer.checkpoints.wait()
        assert pool._flat is reserved  # the save used the buffer allocated before it
        trainer.close()
