"""Saving a tag: every rank writes only its own files, in the foreground or (``--async-save``) in a
background thread; global rank 0 publishes the tag once every rank says its files are there. One
:class:`AsyncSaver` per rank, owned by the checkpoint manager (``megapost.train.checkpoints``).

A tag is written under ``iter_XXXXXXX.tmp``; each rank's file appears under its final name only when
complete (temp name, then rename). Nobody polls the filesystem: the ranks agree that a save is done
with one small all-reduce (:meth:`AsyncSaver._agree`, on a CPU/gloo group, so it never waits on the
device) — right after the write for a synchronous save, and at step boundaries 1, 2, 4, 8, ... then
every 64 while a background save is pending (:meth:`AsyncSaver.poll`, as Megatron-LM finalises its
async saves at the next steps; every rank writes files, so every rank takes part). When every rank's
write is done, rank 0 writes the manifest and publishes the tag (``CheckpointFolder.publish``:
``latest`` names it, tags beyond it are set aside, ``--save-retain`` applied); when one failed, every
rank raises the same one-line error (the file and the OS error) at that step and ``latest`` keeps
naming the previous complete tag. A killed rank leaves a ``.tmp`` tag that ``latest`` never names and
the next save removes.

Under ``--async-save`` the host snapshot is taken by the background thread while the next step's
forward and backward run; the optimizer step, a rollback and a load wait for it first
(:meth:`AsyncSaver.before_state_changes`). That thread then checks the snapshot (exactly what it
writes) is finite: a non-finite one is not written, and every rank stops at the next step boundary in
one line. The next save and the end of training wait for the write and agree
(:meth:`AsyncSaver.wait_pending`); an error or interrupt waits for this rank's write only.

Faults: the ``FaultInjector`` given (``megapost.utils.faults``; a no-op in production) is called with
each file half written and with an async snapshot's first tensor copied.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapost.checkpoint import codec, data_identity, finite_guard
from megapost.checkpoint import safety as checkpoint_safety
from megapost.checkpoint.folder import TMP_SUFFIX, CheckpointFolder, last_complete, tag_of
from megapost.checkpoint.format import FORMAT, META_FILE, write_manifest
from megapost.checkpoint.layout import RunLayout
from megapost.checkpoint.snapshot import HostPool, Snapshot
from megapost.checkpoint.stream_write import Staging
from megapost.checkpoint.writer import RankFiles, rank_files, write_rank_files
from megapost.config.errors import ConfigError
from megapost.config.resolved import Config
from megapost.engine import Engine
from megapost.utils.atomic import atomic_path, atomic_write_text
from megapost.utils.faults import NO_FAULTS, FaultInjector

MESSAGE_BYTES = 1024
POLL_EVERY_AT_MOST = 64  # step boundaries between two agreements on a long pending save
SHARED_MARKER = ".megapost-shared-check"


@dataclass
class _Save:
    """One save in flight on this rank."""

    directory: str
    tag: str
    iteration: int
    rank: int
    world: int
    previous: str | None
    keep: int = 0
    every: int = 0
    interval: int = 0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    written: int = 0
    started_at: float = 0.0  # time.perf_counter() when the background thread began
    done_at: float = 0.0  # time.perf_counter() when the background write ended
    cpu_s: float = 0.0  # CPU time the background thread used
    snapshot: Snapshot | None = None  # until the training thread has waited for it
    boundaries: int = 0  # step boundaries polled while pending (the same count on every rank)

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.directory, self.tag + TMP_SUFFIX)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if distributed():
        dist.barrier()


def one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e} (errno {e.errno})"
    text = str(e.code if isinstance(e, SystemExit) else e).removeprefix("error: ")
    return text.splitlines()[0] if text else type(e).__name__


def agreement_due(n: int) -> bool:
    """Whether the ``n``-th step boundary (from 1) of a pending save agrees: at 1, 2, 4, 8, ... then
    every ``POLL_EVERY_AT_MOST``: O(log) all-reduces over the world per save instead of one per step,
    publishing at most twice as late as the write ends (the same steps on every rank: no host clock)."""
    return n & (n - 1) == 0 or n % POLL_EVERY_AT_MOST == 0


def lower_priority() -> None:
    """This thread only (Linux): ``SCHED_IDLE``, so it runs on CPU that training leaves idle whatever the
    process's nice value (under ``nice`` a nice-19 thread still took ~12 % of a contended core); nice 19
    where ``SCHED_IDLE`` is refused; unchanged where neither exists."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _error(e: BaseException, job: _Save) -> BaseException:
    if isinstance(e, OSError):
        return checkpoint_safety.write_error(e, job.tmp_dir, job.previous) or e
    return e


def publish(job: _Save) -> None:
    """Rank 0, once every rank's files are there: manifest, final name, ``latest``, set-aside, retention."""
    if job.rank != 0:
        return
    write_manifest(job.tmp_dir)
    folder = CheckpointFolder(job.directory)
    folder.publish(job.tag)
    folder.set_aside(job.iteration)  # after a rollback: tags of the abandoned timeline
    if job.keep:
        folder.retain(job.iteration, job.keep, job.every, job.interval)
    if job.thread is not None:  # an async save, now published: its size and the write's seconds
        final = os.path.join(job.directory, job.tag)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(final) for f in fs)
        print(f" async save complete: {final} ({size / 2**30:.3g} GB in "
              f"{job.done_at - job.started_at:.1f} s)", flush=True)


def _write_meta(run: RunLayout, config: Config, tmp_dir: str, tag: str, iteration: int) -> None:
    meta = {"tag": tag, "iteration": iteration, "format": FORMAT,
            "ckpt_format": config.checkpoint.ckpt_format,
            "data": data_identity.of(config.data.sources.prefixes),
            "tensor_model_parallel_size": run.tensor_model_parallel_size,
            "pipeline_model_parallel_size": run.pipeline_model_parallel_size,
            "data_parallel_size": run.data_parallel_size, "zero_stage": run.zero_stage,
            "model": run.shape}
    with atomic_path(os.path.join(tmp_dir, META_FILE)) as tmp, open(tmp, "w") as f:
        json.dump(meta, f)


def client_state(config: Config, iteration: int, consumed: int,
                 plugin_states: dict[str, Any]) -> dict[str, Any]:
    """What a tag keeps besides the Engine's state: counters, RNG, the plugins' states, the tokenizer."""
    return {"iteration": iteration, "consumed_train_samples": consumed, "rng": codec.rng_state(),
            "plugins": plugin_states, "args": {"tokenizer_model": config.data.tokenizer_model}}


class AsyncSaver:
    """This rank's saves: the staging buffer and host pool reused from save to save, the save in flight,
    the CPU group the agreements run on, and the harness's ``faults``."""

    def __init__(self, faults: FaultInjector = NO_FAULTS) -> None:
        self.staging, self.pool, self.faults = Staging(), HostPool(), faults
        self.pending: _Save | None = None
        self._group: list[Any] = []  # the CPU (gloo) group, made at the first save

    def cpu_group(self) -> Any:
        """A gloo group over every rank for small host-side agreements (the default group when it is
        gloo); collective: every rank calls it the first time at the same point."""
        if not self._group:
            self._group.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
        return self._group[0]

    def _agree(self, job: _Save, done: bool) -> bool:
        """Every rank's state of ``job`` in one all-reduce of one integer: True when all have written
        their files, False while one is still writing; raises (on every rank alike) when one failed,
        with the error of the lowest such rank."""
        world, failed = job.world, job.error is not None
        code = 2 * world + (world - 1 - job.rank) if failed else (0 if done else world)
        if distributed():
            flag = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cpu_group())
            code = int(flag[0])
        if code < world:
            return True
        if code < 2 * world:
            return False
        rank = world - 1 - (code - 2 * world)
        message = one_line(_error(job.error, job)) if job.error is not None and job.rank == rank else ""
        if distributed():
            raw = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
            encoded = message.encode()[:MESSAGE_BYTES]
            if encoded:
                raw[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
            dist.all_reduce(raw, op=dist.ReduceOp.MAX, group=self.cpu_group())
            message = bytes(raw.numpy()).rstrip(b"\0").decode(errors="replace")
        raise ConfigError(f"checkpoint {job.tag} not saved: rank {rank}: {message}; 'latest' still names "
                          f"{os.path.basename(job.previous) if job.previous else 'no tag'}")

    def _write(self, job: _Save, files: RankFiles) -> None:
        """Write this rank's files (an error is kept in ``job.error`` for :meth:`_agree`); each file
        passes the fault injector half written."""
        background = job.thread is not None  # it bypasses the page cache: less contention with training

        def pause() -> None:
            self.faults.save_file_half_written(job.iteration, background)

        try:
            job.written = write_rank_files(job.tmp_dir, files, self.staging, pause, direct=background)
        except Exception as e:
            job.error = e

    def _published(self, job: _Save) -> None:
        """:func:`publish` of a background save, then a barrier on the CPU group (once per save): no
        rank reads 'latest' again (the next save's previous tag, its error line) before rank 0 moved it."""
        publish(job)
        if distributed():
            dist.barrier(group=self.cpu_group())

    def _background(self, job: _Save, snapshot: Snapshot) -> None:
        job.started_at = time.perf_counter()
        try:
            snapshot.take()  # at training's priority: the next optimizer step waits for it
            lower_priority()
            host_copies = snapshot.files.training_state()  # what _write writes, less plugin records
            finite_guard.refuse_non_finite(host_copies, (), job.iteration, job.directory, torch.device("cpu"),
                                           everywhere=False)  # a failure reaches every rank via _agree
            self._write(job, snapshot.files)
        except BaseException as e:  # surfaces in poll / wait_pending
            job.error = e
        finally:
            job.done_at, job.cpu_s = time.perf_counter(), time.thread_time()

    def before_state_changes(self) -> None:
        """Call before anything changes the saved state (the optimizer step, a rollback, a load): blocks
        until a background save's host snapshot is taken (host tensors), or orders the device's copies
        before the current stream's next kernels (CUDA; no host synchronisation). Cheap when none."""
        job = self.pending
        if job is not None and job.snapshot is not None:
            job.snapshot.wait()
            job.snapshot = None

    def poll(self) -> None:
        """At a step boundary, on every rank: nothing when no background save is pending or no agreement
        is due (``agreement_due``); else one small all-reduce (host memory, no device sync) — every rank
        done: rank 0 publishes the tag; one failed: every rank raises its one-line error now."""
        job = self.pending
        if job is None or job.thread is None:
            return
        job.boundaries += 1
        if not agreement_due(job.boundaries):
            return
        alive = job.thread.is_alive()
        try:
            if not self._agree(job, done=not alive):
                return
        except BaseException:
            self.pending = None
            raise
        self.pending = None
        job.thread.join()
        self._published(job)

    def wait_pending(self, raise_errors: bool = True) -> int:
        """Block until the background save is written; returns this rank's bytes. ``raise_errors`` (the
        next save, the end of training; every rank): agree, then rank 0 publishes and every rank raises
        a failure. Without it (an error or interrupt path): this rank's write only; the tag stays
        unpublished."""
        job, self.pending = self.pending, None
        if job is None or job.thread is None:
            return 0
        job.thread.join()
        if raise_errors:
            self._agree(job, done=True)
            self._published(job)
        return job.written

    def save(self, engine: Engine, config: Config, iteration: int, consumed: int,
             plugin_states: dict[str, Any], pstate: Any, checked: Sequence[tuple[str, Any]] = (),
             device: torch.device | None = None) -> str:
        """Save tag ``iter_XXXXXXX`` into ``config.checkpoint.save``: this rank's shard (``writer``), the
        Engine's own files too under ``--ckpt-format deepspeed``; returns at once under ``--async-save``
        (the write goes on in a background thread), else when the tag is published. Refuses (one line,
        every rank) unless every tensor written (less the plugins' records) and ``checked`` (named pending
        losses, norms) is finite."""
        self.wait_pending()
        ckpt, run = config.checkpoint, RunLayout.of(config)
        tag = tag_of(iteration)
        job = _Save(ckpt.save, tag, iteration, pstate.global_rank, pstate.world_size,
                    last_complete(ckpt.save), ckpt.save_retain, ckpt.save_retain_every, ckpt.save_interval)
        client = client_state(config, iteration, consumed, plugin_states)
        if distributed():
            self.cpu_group()
        files = rank_files(engine, pstate, run.deepspeed_layout(), client)
        written = [] if ckpt.async_save else files.training_state()
        # --async-save: the writer checks the host snapshot it writes (_background), off the training thread
        finite_guard.refuse_non_finite(written, checked, iteration, ckpt.save, device or torch.device("cpu"))
        try:
            if job.rank == 0:
                CheckpointFolder(ckpt.save).clean()
            barrier()
            if job.rank == 0:
                _write_meta(run, config, job.tmp_dir, tag, iteration)
            if ckpt.ckpt_format == "deepspeed":
                engine.save_native(ckpt.save, tag + TMP_SUFFIX, client)
                barrier()
        except OSError as e:
            raise _error(e, job) from None
        if ckpt.async_save:
            job.snapshot = self.pool.snapshot(files, lambda: self.faults.snapshot_half_taken(iteration))
            job.thread = threading.Thread(target=self._background, args=(job, job.snapshot), daemon=True,
                                          name=f"megapost-save-{tag}")
            self.pending = job
            job.thread.start()
            return tag
        self._write(job, files)
        self._agree(job, done=True)
        publish(job)
        barrier()
        return tag

    def check_shared(self, directory: str, rank: int) -> None:
        """At start-up, on every rank: refuse (one line, every rank alike) a ``--save`` that some rank
        does not see as rank 0 does (a node-local path): rank 0 writes a random token there, every rank
        must read it back. Nothing to check in a single process."""
        if not distributed():
            return
        token = torch.tensor([int.from_bytes(os.urandom(7), "little") + 1], dtype=torch.int64)
        marker = os.path.join(directory, SHARED_MARKER)
        if rank == 0:
            try:
                os.makedirs(directory, exist_ok=True)
                atomic_write_text(marker, str(int(token[0])))
            except OSError as e:  # e.g. a full disk: one line, not a traceback
                raise ConfigError(f"--save {directory}: cannot write there ({e.strerror or e}); free space "
                                  "on it or choose another --save") from None
        dist.broadcast(token, src=0, group=self.cpu_group())
        try:
            with open(marker) as f:
                seen = f.read().strip() == str(int(token[0]))
        except OSError:
            seen = False
        first = torch.tensor([dist.get_world_size() if seen else rank], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.cpu_group())
        if rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(marker)
        if int(first[0]) < dist.get_world_size():
            raise ConfigError(f"--save {directory} is not on a filesystem every rank sees: rank "
                              f"{int(first[0])} cannot read the file rank 0 wrote there (a node-local "
                              "path?); put --save on a filesystem shared by every node")

    def reserve_host(self, engine: Engine, config: Config, plugin_states: dict[str, Any], pstate: Any) -> int:
        """--async-save: allocate this rank's flat host buffer now, sized for the files a save would
        write, so the first save does not pay for it; returns its bytes. Call once the optimizer's
        moments exist (after the first optimizer step); a later save re-sizes only if its files differ."""
        client = client_state(config, 0, 0, plugin_states)
        files = rank_files(engine, pstate, RunLayout.of(config).deepspeed_layout(), client)
        return self.pool.reserve(files).numel()
