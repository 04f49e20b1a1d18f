"""A failed background save is seen at once, on every rank, in one line; ``latest`` keeps the previous
tag; a node-local ``--save`` is refused; retention after a rollback (literal tags)."""

from __future__ import annotations

import pytest
import torch
from ckpt_faults import (
    failing_write,
    full_tensors,
    poisoned_moment,
    resume_reads,
    rollback,
    shared_check,
    train,
)
from dist_utils import run_ranks
from launch_utils import tiny_model_flags


def _argv(data, ckpt, **flags) -> list[str]:
    return [str(a) for a in tiny_model_flags(data, **{"--save": ckpt, "--save-interval": 2,
                                                        "--lr-decay-iters": 10, "--log-interval": 100,
                                                        **flags})]


@pytest.mark.integration
@pytest.mark.slow
def test_node_local_save_is_refused_in_one_line(tmp_path) -> None:
    shared, local = zip(*run_ranks(shared_check, 2, str(tmp_path), timeout=300), strict=True)
    assert shared == (None, None)
    for rank, line in enumerate(local):  # each rank names its own path (on a cluster: the same string)
        assert line.startswith(f"error: --save {tmp_path}/node{rank} is not on a filesystem every rank sees: "
                               "rank 1 cannot read the file rank 0 wrote there") and "\n" not in line


@pytest.mark.integration
@pytest.mark.slow
def test_failed_background_write_reaches_every_rank_at_the_next_step(tiny_data, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = _argv(tiny_data, ckpt, **{"--train-iters": 8, "--async-save": True, "--global-batch-size": 4})
    by_rank = run_ranks(failing_write, 2, argv, 1, "iter_0000004", timeout=600)
    for r in by_rank:
        print(f"rank message: {r['message']!r} after iteration {r['iteration']}")
    messages = {r["message"] for r in by_rank}
    assert len(messages) == 1, by_rank  # the same line on every rank
    (message,) = messages
    assert message.startswith("error: checkpoint iter_0000004 not saved: rank 1: ")
    assert "iter_0000004.tmp/layout_free/shard-tp00-pp00-dp01.safetensors: Read-only file system (errno 30)" \
        in message and message.endswith("'latest' still names iter_0000002") and "\n" not in message
    iterations = {r["iteration"] for r in by_rank}
    assert len(iterations) == 1 and iterations <= {4, 5}, by_rank  # at the first step boundary after it
    assert (ckpt / "latest").read_text() == "iter_0000002" and not (ckpt / "iter_0000004").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_retention_after_a_rollback(tiny_data, tmp_path) -> None:
    # saves at 2, 4, 6, 8 (keep 2: 6, 8 left); after 8 back to the snapshot of 3; then 4 is saved again:
    # 6 and 8 (of the abandoned timeline) are set aside, retention keeps the newest 2 of this timeline
    # (keeping the newest 2 by number would have kept the stale 6 and 8 and deleted 4 at the save of 6)
    ckpt = tmp_path / "ckpt"
    seen = run_ranks(rollback, 1, _argv(tiny_data, ckpt, **{"--train-iters": 10, "--save-retain": 2}), 3, 8,
                     str(ckpt), timeout=600)[0]
    assert seen[4] == ["iter_0000004"]
    assert seen[6] == ["iter_0000004", "iter_0000006"]
    assert seen[10] == ["iter_0000008", "iter_0000010"]
    aside = sorted(p.name for p in (ckpt / "set-aside").iterdir())
    assert aside == ["iter_0000006", "iter_0000008"]
    assert (ckpt / "latest").read_text() == "iter_0000010"


@pytest.mark.integration
@pytest.mark.slow
def test_the_finite_check_covers_the_optimizer_state_written(tiny_data, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    message = run_ranks(poisoned_moment, 1, _argv(tiny_data, ckpt, **{"--train-iters": 2}), timeout=600)[0]
    assert message is not None and message.startswith("not saving a non-finite training state")
    assert not (ckpt / "latest").exists() and not list(ckpt.glob("iter_*"))


@pytest.mark.integration
@pytest.mark.slow
def test_an_async_save_checks_the_snapshot_it_writes(tiny_data, tmp_path) -> None:
    # the finite check of --async-save runs in the writer thread on the host copy it writes (not on the
    # training thread); a NaN moment: nothing published, one line at the next step boundary
    ckpt = tmp_path / "ckpt"
    argv = _argv(tiny_data, ckpt, **{"--train-iters": 4, "--async-save": True})
    message = run_ranks(poisoned_moment, 1, argv, timeout=600)[0]
    assert message is not None and message.startswith(
        "error: checkpoint iter_0000002 not saved: rank 0: not saving a non-finite training state"), message
    assert message.endswith("'latest' still names no tag") and "\n" not in message, message
    assert not (ckpt / "latest").exists() and not (ckpt / "iter_0000002").exists()


@pytest.mark.integration
@pytest.mark.slow  # a DP4 save, two DP4 and two DP3 resumes on 2 cores: ~5 min (10 on a loaded box)
def test_resume_reads_its_own_shard_at_the_same_layout_and_its_fragments_at_another(tiny_data,
                                                                                     tmp_path) -> None:
    # DP4 ZeRO-1: each rank's shard is a quarter of the state; the resume (same layout) reads its own
    # file (+ the small state file); assembling as for another layout reads every rank's fragments.
    # At DP3 each rank needs a third of the state, its partition's boundaries inside DP4 fragments: it reads
    # the byte ranges of the DP4 fragments overlapping its partition (~ its need) instead of everything
    # (~3x), and trains on as assembling would, bit for bit.
    ckpt = tmp_path / "ckpt"
    flags = {"--hidden-size": 256, "--ffn-hidden-size": 512, "--global-batch-size": 8, "--zero-stage": 1,
             "--save-interval": 2}
    run_ranks(train, 4, _argv(tiny_data, ckpt, **{**flags, "--train-iters": 2}), timeout=900)
    resume = _argv(tiny_data, tmp_path / "unused", **{**flags, "--train-iters": 3, "--load": ckpt})
    for assembled, low, high in ((False, 0.95, 1.1), (True, 3.5, 4.5)):
        for r, got in enumerate(run_ranks(resume_reads, 4, resume, assembled, timeout=900)):
            ratio = sum(got["read"].values()) / got["own"]
            total = sum(got["read"].values())
            print(f"DP4 {'assembled' if assembled else 'own shard'}: rank {r} read {total} bytes / its shard "
                  f"{got['own']} = {ratio:.3f} ({sorted(got['read'])})")
            assert low <= ratio <= high, (assembled, r, got)
            if not assembled:
                assert set(got["read"]) == {f"shard-tp00-pp00-dp{r:02d}.safetensors", "state.safetensors"}
    tags = {}
    for assembled, low, high in ((False, 0.95, 1.1), (True, 2.7, 3.3)):
        again = tmp_path / f"dp3-{assembled}"  # resumed at DP3, one step, saved
        dp3 = {**flags, "--train-iters": 3, "--load": ckpt, "--global-batch-size": 6}
        argv = _argv(tiny_data, again, **dp3)
        for r, got in enumerate(run_ranks(resume_reads, 3, argv, assembled, timeout=900)):
            ratio = sum(got["read"].values()) / got["need"]
            print(f"DP4 -> DP3 {'assembled' if assembled else 'fragment ranges'}: rank {r} read "
                  f"{sum(got['read'].values())} bytes / its shard at DP3 {got['need']} = {ratio:.3f}")
            assert low <= ratio <= high, (assembled, r, got)
        tags[assembled] = full_tensors(again / "iter_0000003")
    assert tags[False].keys() == tags[True].keys()
    for key, tensor in tags[True].items():  # the same state loaded both ways: the same step, bit for bit
        assert not tensor.isnan().any() and torch.equal(tags[False][key], tensor), key


def test_the_background_writer_runs_at_idle_priority_and_training_does_not(monkeypatch, tmp_path) -> None:
    """The writer thread is ``SCHED_IDLE`` while it writes (so a ``nice``d run does not lift it to a share
    of a busy core); the training thread's policy and nice value are untouched."""
    import os
    import threading

    from megapost.checkpoint import saver
    from megapost.checkpoint.snapshot import Snapshot
    from megapost.checkpoint.writer import RankFiles

    seen: dict[str, int] = {}

    def record(job, files) -> None:
        seen["policy"] = os.sched_getscheduler(0)  # 0: the calling thread (Linux)

    monkeypatch.setattr(saver.AsyncSaver, "_write", lambda self, job, files: record(job, files))
    before = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
    live, host = torch.ones(8), torch.empty(8)
    files = RankFiles([("f.safetensors", [("w", host)], {})])
    job = saver._Save(str(tmp_path), "iter_0000001", 1, 0, 1, None)
    snapshot = Snapshot(files, [(host, live)], None)
    thread = threading.Thread(target=saver.AsyncSaver()._background, args=(job, snapshot))
    thread.start()
    thread.join()
    assert job.error is None and torch.equal(host, live)  # the snapshot was taken, then written
    assert seen == {"policy": os.SCHED_IDLE}
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == before
