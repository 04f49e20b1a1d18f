"""How a sweep runs its trainings: one ``python -m megapost.pretrain`` process per run (``subprocess``, the
reference path) or long-lived worker processes that import torch/DeepSpeed once and train run after run
in-process (``persistent``); and the adaptive seed schedule of a probe.

A persistent worker starts each run as a fresh process would: torch's global RNG back at the state a
new process starts with, the world-of-one process group created and destroyed by the run itself
(``megapost.pretrain.run``), the run's stdout/stderr (file descriptors 1 and 2, so C++ output too) in
the run's ``train.log``. A run that raises ends its worker (a new one takes over), so a failure cannot
leave state behind for the next run. ``tests/test_sweep_engine.py`` checks that both paths give
bit-identical per-step metrics. ``--flush-denormal`` (both paths) sets ``torch.set_flush_denormal(True)``
before the run: Adam's second moments of a collapsed run's vanishing gradients fall below 1e-38, where
the CPU's denormal arithmetic is slow.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

ENGINES = ("subprocess", "persistent")



def _device_env(slot: int, devices: int) -> dict[str, str]:
    """One cell per GPU: the slot's device only (no GPUs: nothing)."""
    return {"CUDA_VISIBLE_DEVICES": str(slot % devices)} if devices > 0 else {}


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _train(argv: Sequence[str], flush_denormal: bool, initial_seed: int | None) -> None:
    """One training in this process, started as a new process would be."""
    import torch

    from megapost.pretrain import run

    if initial_seed is not None:
        torch.manual_seed(initial_seed)  # the generator state a fresh process starts with
    torch.set_flush_denormal(flush_denormal)
    run(list(argv))


def _serve(conn: Any, env: dict[str, str], niceness: int) -> None:
    """A persistent worker: gets (argv, log path, flush), answers (exit code, seconds); None ends it."""
    os.environ.update(env)
    if niceness:
        os.nice(niceness)
    import torch

    import megapost.pretrain  # noqa: F401  (torch, DeepSpeed and megapost imported once)

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch may have come in with spawn's __main__

    seed = torch.initial_seed()
    while (msg := conn.recv()) is not None:
        argv, log, flush = msg
        start, rc = time.monotonic(), 0
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(log, "w", encoding="utf-8") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                _train(argv, flush, seed)
            except BaseException as e:  # noqa: BLE001  (the run's error goes to its log; the worker ends)
                rc = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        conn.send((rc, time.monotonic() - start))
        if rc != 0:
            return


class Slots:
    """``size`` run slots (slot i: the i-th GPU when there are GPUs); ``run`` blocks until a slot is free,
    so it can be called from a thread pool of any size. This class is the reference path: one new
    process per run."""

    engine = "subprocess"

    def __init__(self, size: int, niceness: int = 0, devices: int = 0) -> None:
        self.niceness, self.devices = niceness, devices
        self.free: queue.Queue[int] = queue.Queue()
        for slot in range(max(1, size)):
            self.free.put(slot)

    def run(self, argv: Sequence[str], log: Path, flush_denormal: bool) -> int:
        """Train ``argv`` with its output in ``log``; the exit code."""
        slot = self.free.get()
        try:
            return self._run(slot, argv, log, flush_denormal)
        finally:
            self.free.put(slot)

    def _run(self, slot: int, argv: Sequence[str], log: Path, flush_denormal: bool) -> int:
        """``python -m megapost.pretrain ARGV`` (with ``flush_denormal``: ``python tools/sweep_engine.py
        ARGV``, the same after the denormal setting)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", **_device_env(slot, self.devices))
        entry = [str(Path(__file__).resolve())] if flush_denormal else ["-m", "megapost.pretrain"]
        with open(log, "w", encoding="utf-8") as f:
            return subprocess.call(["nice", "-n", str(self.niceness), sys.executable, *entry, *argv],
                                   stdout=f, stderr=subprocess.STDOUT, env=env)

    def close(self) -> None:
        """Nothing is left running between runs."""


class WorkerPool(Slots):
    """One persistent worker per slot (spawned at its first run, one torch thread, niced)."""

    engine = "persistent"

    def __init__(self, size: int, niceness: int = 0, devices: int = 0) -> None:
        super().__init__(size, niceness, devices)
        self.ctx = mp.get_context("spawn")
        self.workers: dict[int, tuple[Any, Any]] = {}
        self.lock = threading.Lock()

    def _worker(self, slot: int) -> tuple[Any, Any]:
        with self.lock:
            if slot not in self.workers or not self.workers[slot][0].is_alive():
                parent, child = self.ctx.Pipe()
                env = {"OMP_NUM_THREADS": "1", **_device_env(slot, self.devices)}
                proc = self.ctx.Process(target=_serve, args=(child, env, self.niceness), daemon=True)
                proc.start()
                self.workers[slot] = (proc, parent)
            return self.workers[slot]

    def _run(self, slot: int, argv: Sequence[str], log: Path, flush_denormal: bool) -> int:
        proc, conn = self._worker(slot)
        conn.send((list(argv), str(log), flush_denormal))
        try:
            rc, _ = conn.recv()
        except EOFError:  # the worker died (killed, out of memory): a new one next time
            rc = 1
        if rc != 0:
            proc.join(10)  # a failed run ends its worker
        return int(rc)

    def close(self) -> None:
        for proc, conn in self.workers.values():
            if proc.is_alive():
                conn.send(None)
                proc.join(10)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of how every run is set up and executed (shared with tools/collapse_boundary.py)."""
    p.add_argument("--heads", type=int, default=4, help="--num-attention-heads of every run")
    p.add_argument("--init-variance", choices=("paper", "std"), default="paper",
                   help="--init-variance of every run")
    p.add_argument("--decay-style", default="cosine", choices=("cosine", "linear", "constant"),
                   help="--lr-decay-style of every run, recorded in results.csv (decay_style)")
    p.add_argument("--jobs", "--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="runs at once (persistent engine: worker processes)")
    p.add_argument("--engine", choices=ENGINES, default="persistent",
                   help="persistent: long-lived workers train run after run in-process (torch and DeepSpeed "
                   "imported once); subprocess: one python -m megapost.pretrain per run. Same results "
                   "(tests/test_sweep_engine.py)")
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True) in every run (collapsed runs' denormal Adam moments)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the runs")
    p.add_argument("--collapse-grad-ratio", type=float, default=1e-2, metavar="R",
                   help="results.csv's collapsed = 1 when a run ends collapsed (outcome.py) with a final "
                   "first/last-layer gradient ratio <= R (the collapsed state; a short healthy run still "
                   "on the initial unigram plateau has t_sim ~1 and loss ~L too, but live "
                   "gradients); 0: the outcome alone")


def make_pool(engine: str, size: int, niceness: int) -> Slots:
    """The run slots of ``--engine``: ``size`` of them, each on its own GPU when there are GPUs."""
    return (WorkerPool if engine == "persistent" else Slots)(size, niceness, cuda_devices())


def seeds_to_launch(k: int, done: int, running: int, total: int) -> int:
    """Adaptive seeds: how many more seeds of a probe to start now, given k collapsed of ``done``
    finished and ``running`` in flight, out of ``total``. The probe collapses when 2k >= total; it is
    decided once no outcome of the remaining seeds can change that, and then nothing more starts. Starts
    the fewest further results that could decide it (all at once, so the seeds run in parallel)."""
    left = total - done - running
    if left <= 0 or 2 * k >= total or 2 * (k + total - done) < total:
        return 0
    need_collapse = -(-total // 2) - k  # further collapses that decide "collapses"
    need_stable = k + total - done - (-(-total // 2)) + 1  # further non-collapses that decide "stable"
    return max(0, min(need_collapse, need_stable, left) - running)


def decided(k: int, done: int, total: int) -> bool:
    return 2 * k >= total or 2 * (k + total - done) < total


Job = tuple[Any, int]  # (probe key, seed)


def run_probes(probes: dict[Any, list[int]], run_one: Callable[[Any, int], dict[str, Any] | None],
               is_collapsed: Callable[[dict[str, Any]], bool], jobs: int, adaptive: bool
               ) -> dict[Any, list[dict[str, Any]]]:
    """Every probe's seeds through ``run_one`` on ``jobs`` threads; with ``adaptive``, a probe stops once
    its majority vote is decided (``seeds_to_launch``). Returns each probe's finished results in seed
    order (a failed run, None, is left out and counts as not run)."""
    state = {key: {"seeds": list(seeds), "next": 0, "k": 0, "done": 0, "running": 0, "out": {}}
             for key, seeds in probes.items()}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        flying: dict[Future, Job] = {}

        def launch() -> None:
            for key, s in state.items():
                total = len(s["seeds"])
                n = (seeds_to_launch(s["k"], s["done"], s["running"], total) if adaptive
                     else total - s["next"])
                for _ in range(n):
                    seed = s["seeds"][s["next"]]
                    s["next"], s["running"] = s["next"] + 1, s["running"] + 1
                    flying[pool.submit(run_one, key, seed)] = (key, seed)

        launch()
        while flying:
            finished, _ = wait(list(flying), return_when=FIRST_COMPLETED)
            for fut in finished:
                key, seed = flying.pop(fut)
                s, result = state[key], fut.result()
                s["running"] -= 1
                if result is None:  # failed: the seed is spent; the vote is over the others
                    s["seeds"].remove(seed)
                    s["next"] -= 1
                else:
                    s["done"] += 1
                    s["k"] += int(is_collapsed(result))
                    s["out"][seed] = result
            launch()
    return {key: [s["out"][seed] for seed in sorted(s["out"])] for key, s in state.items()}


def main(argv: Sequence[str]) -> None:
    """One training, as ``python -m megapost.pretrain`` but with MEGAPOST_SWEEP_FLUSH_DENORMAL applied."""
    import torch

    torch.set_flush_denormal(os.environ.get("MEGAPOST_SWEEP_FLUSH_DENORMAL") == "1")
    from megapost.pretrain import main as pretrain_main

    pretrain_main(list(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
