"""Saving a tag: every rank writes only its own files, in the foreground or (``--async-save``) in a
background thread; global rank 0 publishes the tag once every rank's files are there.

A tag is written under ``iter_XXXXXXX.tmp``. Each rank's file appears under its final name only when
complete (temp name, then rename), so rank 0 knows the tag is whole by seeing every expected file —
no collective runs in the background, none is needed to finish a save. Rank 0 then writes the
manifest, renames the tag, replaces ``latest`` (both atomic) and applies ``--save-retain``. A rank
whose write fails leaves ``layout_free/.failed-rankN`` (its error) so rank 0 stops waiting; a killed
rank leaves a ``.tmp`` tag that ``latest`` never names and the next save removes.

Under ``--async-save`` the host snapshot is taken by the background thread while the next step's
forward and backward run; the optimizer step, a rollback and a load wait for it first
(:func:`before_state_changes`). The next save, the end of training and an interrupt wait for a background save
(:func:`wait_pending`); its errors (a full disk: one line naming the last complete tag) surface there.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megapost.checkpoint import io, retention, sharded
from megapost.checkpoint import layout_free as lf
from megapost.checkpoint import safety as checkpoint_safety
from megapost.checkpoint.stream_write import Staging
from megapost.config.resolved import Config
from megapost.utils.atomic import atomic_path, atomic_write_text

FAILED = ".failed-rank"
_STAGING = Staging()
_POOL = sharded.HostPool()


@dataclass
class _Save:
    """One save in flight on this rank."""

    directory: str
    tag: str
    rank: int
    expected: list[str]  # files (relative to the tag) every rank must have written
    previous: str | None
    keep: int = 0
    every: int = 0
    interval: int = 0
    timeout_s: float = 600.0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    written: int = 0
    done_at: float = 0.0  # time.perf_counter() when the background write ended
    cpu_s: float = 0.0  # CPU time the background thread used
    snapshot: sharded.Snapshot | None = None  # until the training thread has waited for it

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.directory, self.tag + io.TMP_SUFFIX)


_pending: _Save | None = None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(directory: str, tmp_tag: str, tag: str) -> None:
    """The complete temp tag takes the final name, then ``latest`` names it (both atomic)."""
    final, old = os.path.join(directory, tag), os.path.join(directory, f"{tag}.old{io.TMP_SUFFIX}")
    if os.path.exists(final):  # the same iteration saved again: move the old copy aside first
        os.replace(final, old)
    os.replace(os.path.join(directory, tmp_tag), final)
    _fsync_dir(directory)
    atomic_write_text(os.path.join(directory, "latest"), tag)
    _fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)


def _wait_for_files(job: _Save) -> None:
    deadline = time.monotonic() + job.timeout_s
    while True:
        missing = [n for n in job.expected if not os.path.exists(os.path.join(job.tmp_dir, n))]
        if not missing:
            return
        failed = sorted(glob.glob(os.path.join(job.tmp_dir, lf.DIR, FAILED + "*")))
        if failed:
            with open(failed[0]) as f:
                raise RuntimeError(f"checkpoint {job.tmp_dir} not published: {f.read().strip()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {job.tmp_dir} not published: {len(missing)} files of other ranks "
                               f"missing after {job.timeout_s:.0f} s (first: {missing[0]})")
        time.sleep(0.02)


def _test_pause(tag: str, var: str = "MEGAPOST_SLOW_SAVE") -> Any:
    """``MEGAPOST_SLOW_SAVE=ITER:SECONDS`` (tests: kill -9 during a write): the save of iteration ITER
    sleeps SECONDS with its first file half written; ``MEGAPOST_SLOW_SNAPSHOT``: with its async
    snapshot's first tensor copied (the next optimizer step must wait)."""
    spec = os.environ.get(var, "")
    if ":" not in spec or tag != f"iter_{int(spec.split(':')[0]):07d}":
        return None
    return lambda: time.sleep(float(spec.split(":")[1]))


def _finish(job: _Save, files: sharded.RankFiles) -> None:
    """Write this rank's files; rank 0 then publishes the tag and applies retention."""
    try:
        job.written = sharded.write_rank_files(job.tmp_dir, files, _STAGING, _test_pause(job.tag))
        if job.rank == 0:
            _wait_for_files(job)
            lf.write_manifest(job.tmp_dir)
            _publish(job.directory, job.tag + io.TMP_SUFFIX, job.tag)
            if job.keep:
                retention.apply(job.directory, job.keep, job.every, job.interval)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.join(job.tmp_dir, lf.DIR), exist_ok=True)
            with open(os.path.join(job.tmp_dir, lf.DIR, f"{FAILED}{job.rank}"), "w") as f:
                f.write(f"rank {job.rank}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        raise


def _background(job: _Save, snapshot: sharded.Snapshot) -> None:
    started = time.perf_counter()
    try:
        snapshot.take()  # at training's priority: the next optimizer step waits for it
        with contextlib.suppress(OSError, AttributeError):  # this thread only (Linux): idle CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        _finish(job, snapshot.files)
        if job.rank == 0:  # published: one line with the tag's size and the write's seconds
            final = os.path.join(job.directory, job.tag)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(final) for f in fs)
            print(f" async save complete: {final} ({size / 2**30:.3g} GB in "
                  f"{time.perf_counter() - started:.1f} s)", flush=True)
    except BaseException as e:  # surfaces in wait_pending
        job.error = e
    finally:
        job.done_at, job.cpu_s = time.perf_counter(), time.thread_time()


def _error(e: BaseException, job: _Save) -> BaseException:
    if isinstance(e, OSError):
        return checkpoint_safety.write_error(e, job.tmp_dir, job.previous) or e
    return e


def before_state_changes() -> None:
    """Call before anything changes the saved state (the optimizer step, a rollback, a load): blocks
    until a background save's host snapshot is taken (host tensors), or orders the device's copies
    before the current stream's next kernels (CUDA; no host synchronisation). Cheap when none."""
    job = _pending
    if job is not None and job.snapshot is not None:
        job.snapshot.wait()
        job.snapshot = None


def wait_pending(raise_errors: bool = True) -> int:
    """Block until this rank's background save is written (rank 0: and published); returns its bytes.
    Its error is raised here (``raise_errors``) — a full disk as the one-line ConfigError."""
    global _pending
    job, _pending = _pending, None
    if job is None or job.thread is None:
        return 0
    job.thread.join()
    if job.error is not None and raise_errors:
        raise _error(job.error, job) from None
    return job.written


def _write_meta(run: io.RunLayout, ckpt_format: str, tmp_dir: str, tag: str, iteration: int) -> None:
    meta = {"tag": tag, "iteration": iteration, "format": sharded.FORMAT, "ckpt_format": ckpt_format,
            "tensor_model_parallel_size": run.tensor_model_parallel_size,
            "pipeline_model_parallel_size": run.pipeline_model_parallel_size,
            "data_parallel_size": run.data_parallel_size, "zero_stage": run.zero_stage,
            "model": run.shape}
    with atomic_path(os.path.join(tmp_dir, io.META_FILE)) as tmp, open(tmp, "w") as f:
        json.dump(meta, f)


def save(engine: Any, config: Config, iteration: int, consumed: int, plugin_states: dict[str, Any],
         pstate: Any) -> str:
    """Save tag ``iter_XXXXXXX`` into ``config.checkpoint.save``: this rank's shard
    (``checkpoint.sharded``), DeepSpeed's files too under ``--ckpt-format deepspeed``; returns at once
    under ``--async-save`` (the write goes on in a background thread), else when the tag is published."""
    global _pending
    wait_pending()
    ckpt, run = config.checkpoint, io.RunLayout.of(config.flags)
    tag = f"iter_{iteration:07d}"
    expected = [f"{lf.DIR}/{n}" for n in [*sharded.all_shard_files(pstate), lf.STATE]]
    job = _Save(ckpt.save, tag, pstate.global_rank, expected, io.last_complete(ckpt.save),
                ckpt.save_retain, ckpt.save_retain_every, ckpt.save_interval,
                60.0 * config.parallel.distributed_timeout_minutes)
    client = {"iteration": iteration, "consumed_train_samples": consumed, "rng": io.rng_state(),
              "plugins": plugin_states,
              "args": {k: v for k, v in config.flags.items() if isinstance(v, (int, float, str, bool))}}
    try:
        if job.rank == 0:
            io.remove_temp_tags(ckpt.save)
        _barrier()
        if job.rank == 0:
            _write_meta(run, ckpt.ckpt_format, job.tmp_dir, tag, iteration)
        if ckpt.ckpt_format == "deepspeed":
            engine.save_checkpoint(ckpt.save, tag=tag + io.TMP_SUFFIX, client_state=client, save_latest=False)
            _barrier()
        files = sharded.rank_files(engine, pstate, run.deepspeed_layout(), client)
        if ckpt.async_save:
            job.snapshot = _POOL.snapshot(files, _test_pause(tag, "MEGAPOST_SLOW_SNAPSHOT"))
            job.thread = threading.Thread(target=_background, args=(job, job.snapshot), daemon=True,
                                          name=f"megapost-save-{tag}")
            _pending = job
            job.thread.start()
            return tag
        _finish(job, files)
        _barrier()
    except OSError as e:
        raise _error(e, job) from None
    return tag
