"""Soak: train a tiny model with the real trainer under DeepSpeed's launcher (2 CPU ranks, gloo), SIGKILL
a rank again and again — inside forward, backward, the optimizer step, a synchronous save, an async
write, evaluation, the data index build (``tools/fault_pretrain.py --kill-point``: the rank kills itself
at a seeded pass) and at random wall-clock moments (this supervisor kills a rank's pid) — relaunch the whole
job each time as a cluster requeue would (it resumes from ``latest``), fill the disk once during an
async write (ENOSPC), then compare with an uninterrupted run of the same config: the final checkpoint's
tensors, every TensorBoard scalar series and the JSONL log, bit for bit, each step exactly once.

    python tools/soak.py --work /tmp/soak [--steps 60] [--seed 0] [--json report.json]

``--save`` lives on a tmpfs mounted for the soak when this process may mount one (root); the ENOSPC
case then fills that real filesystem. Otherwise the writer raises ENOSPC by fault injection
(``tools/fault_pretrain.py --enospc``), and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak_compare  # noqa: E402
import soak_parts  # noqa: E402

from megapost.checkpoint.folder import tag_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KILL_LINE = re.compile(r"megapost kill point: SIGKILL rank (\d+) \(pid \d+\) in (\w+) \(pass (\d+)\)")
STEP_PHASES = ("forward", "backward", "optimizer_step", "sync_save", "async_write", "eval")


@dataclass
class SoakConfig:
    work: str
    steps: int = 60
    layers: int = 3
    kills_per_phase: int = 3  # forward, backward, optimizer step, sync save, async write, eval
    index_kills: int = 2  # kills in the data index build (the cache is removed before the second)
    wall_kills: int = 3  # kills of a random rank at a random wall-clock moment
    save_interval: int = 2
    log_interval: int = 3
    eval_interval: int = 5
    seed: int = 0
    timeout: float = 600.0  # per launch


@dataclass
class Attempt:
    index: int
    kind: str  # a phase, "wall-clock", "enospc" or "finish"
    rank: int | None
    async_save: bool
    hit: int = 0
    resumed_from: int = 0
    rc: int | None = None
    seconds: float = 0.0
    killed: str | None = None  # the phase the kill line named (or "wall-clock")
    enospc_line: str | None = None


def flags(cfg: SoakConfig, data: dict[str, str], run_dir: str, save: str, async_save: bool) -> list[str]:
    out = ["--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
           "--data-cache-dir", os.path.join(run_dir, "index-cache"), "--num-layers", str(cfg.layers),
           "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
           "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--train-iters", str(cfg.steps), "--lr", "3e-3", "--lr-warmup-iters", "4",
           "--lr-decay-iters", str(cfg.steps), "--log-interval", str(cfg.log_interval),
           "--eval-interval", str(cfg.eval_interval), "--eval-iters", "2", "--seed", "7",
           "--save-interval", str(cfg.save_interval), "--save", save,
           "--runs-dir", os.path.dirname(run_dir), "--run-name", os.path.basename(run_dir),
           "--plugins", "collapse_metrics", "--collapse-image-interval", "0",
           "--zero-stage", "1", "--distributed-timeout-minutes", "5"]
    return out + (["--async-save"] if async_save else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: list[str], log: str, env: dict[str, str], watch: Any, timeout: float,
           faults: list[str] | None = None) -> tuple[int, float, Any]:
    """One job: DeepSpeed's launcher, 2 ranks, through the fault harness (``faults``: its FAULTS flags;
    none: an ordinary run); ``watch(proc)`` (None: nothing) runs while it does (a wall-clock kill, the
    disk filler). Returns (exit status, seconds, what ``watch`` returned)."""
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tools" / "fault_pretrain.py"), *(faults or []), *argv]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        watched = watch(proc, log) if watch else None
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            soak_parts.kill_tree(proc)
            rc = proc.wait()
    return rc, time.perf_counter() - start, watched


def child_env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "plugins"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return {**env, **extra}


def plan(cfg: SoakConfig, rng: random.Random) -> list[Attempt]:
    """The seeded schedule: index-build kills first (a fresh cache), the rest shuffled, the ENOSPC
    attempt in the middle, a final attempt without a fault."""
    kinds = [p for p in STEP_PHASES for _ in range(cfg.kills_per_phase)] + ["wall-clock"] * cfg.wall_kills
    rng.shuffle(kinds)
    kinds.insert(len(kinds) // 2, "enospc")
    kinds = ["index_build"] * min(cfg.index_kills, 1) + kinds
    if cfg.index_kills > 1:
        kinds.insert(len(kinds) * 2 // 3, "index_build")
    out = []
    for i, kind in enumerate(kinds + ["finish"]):
        async_save = {"sync_save": False, "async_write": True, "enospc": True}.get(kind, rng.random() < 0.5)
        out.append(Attempt(i, kind, rng.randrange(2), async_save))
    return out


def pass_to_kill(cfg: SoakConfig, a: Attempt, iteration: int, kills_left: int, rng: random.Random) -> int:
    """Which pass of ``a.kind`` on the rank to kill at: within the next few steps (fewer when few
    steps are left for the kills still planned), at the first save or evaluation to come."""
    window = max(1, min(6, (cfg.steps - iteration) // max(1, kills_left)))
    micro = 8 // (2 * 2)  # global batch / (micro batch x data-parallel ranks)
    return {"forward": rng.randint(1, micro * window), "backward": rng.randint(1, micro * window),
            "optimizer_step": rng.randint(1, window), "eval": 1, "index_build": rng.randint(1, 2),
            "sync_save": rng.randint(1, 2 if a.rank == 1 else 1),  # the last rank writes 2 files
            "async_write": rng.randint(1, 2 if a.rank == 1 else 1)}[a.kind]


def run_attempt(cfg: SoakConfig, a: Attempt, ctx: dict[str, Any], kills_left: int,
                rng: random.Random) -> None:
    """Launch attempt ``a`` with its fault and record what happened."""
    save, run_dir = ctx["save"], ctx["run_dir"]
    a.resumed_from = soak_parts.latest_iteration(save)
    faults: list[str] = []
    wall = None
    if a.kind in STEP_PHASES or a.kind == "index_build":
        a.hit = pass_to_kill(cfg, a, a.resumed_from, kills_left, rng)
        faults += ["--kill-point", f"{a.kind}:{a.hit}:{a.rank}"]
        if a.kind == "index_build":  # a fresh node's scratch: the indices are built again
            shutil.rmtree(os.path.join(run_dir, "index-cache"), ignore_errors=True)
    log = os.path.join(ctx["logs"], f"attempt-{a.index:02d}-{a.kind}.log")
    if a.kind == "wall-clock":
        delay = rng.uniform(0.0, 3.0)
        wall = lambda proc, log: soak_parts.wall_clock_kill(proc, log, delay, int(a.rank or 0))  # noqa: E731
    elif a.kind == "enospc":
        more, wall = soak_parts.fill_disk(save, ctx["tmpfs"], cfg.save_interval)
        faults += more
    argv = flags(cfg, ctx["data"], run_dir, save, a.async_save)
    a.rc, a.seconds, killed_rank = launch(argv, log, child_env({}), wall, cfg.timeout, faults)
    text = Path(log).read_text(errors="replace")
    match = KILL_LINE.search(text)
    if match:
        a.killed = match.group(2)
        assert int(match.group(1)) == a.rank, (a, match.group(0))
    elif a.kind == "wall-clock" and killed_rank is not None and a.rc != 0:
        a.killed = "wall-clock"
    if a.kind == "enospc":
        soak_parts.empty_disk(save)
        a.enospc_line = next((ln.strip() for ln in text.splitlines() if "not saved:" in ln), None)
        ctx["enospc"] = soak_parts.enospc_facts(a, text, save)


def _defer_enospc(attempts: list[Attempt], i: int, latest: int) -> None:
    """The ENOSPC attempt waits until a complete tag exists (swapped with the next faulty attempt), so
    it shows that 'latest' keeps naming the previous tag, not merely that there is none."""
    if attempts[i].kind == "enospc" and not latest and i + 1 < len(attempts) and \
            attempts[i + 1].kind != "finish":
        attempts[i], attempts[i + 1] = attempts[i + 1], attempts[i]
        attempts[i].index, attempts[i + 1].index = i, i + 1


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    data = soak_parts.make_data(str(work / "data"))
    tmpfs = soak_parts.mount_tmpfs(str(work / "save-fs"))
    ctx = {"save": str(work / "save-fs" / "ckpt"), "run_dir": str(work / "runs" / "soak"),
           "logs": str(work / "logs"), "data": data, "tmpfs": tmpfs}
    os.makedirs(ctx["logs"], exist_ok=True)
    attempts = plan(cfg, rng)
    planned_kills = sum(a.kind not in ("enospc", "finish") for a in attempts)
    started = time.perf_counter()
    try:
        i = 0
        while i < len(attempts) or soak_parts.latest_iteration(ctx["save"]) < cfg.steps:
            if i >= len(attempts):  # an extra relaunch to finish (e.g. a kill that did not fire)
                attempts.append(Attempt(i, "finish", None, False))
            _defer_enospc(attempts, i, soak_parts.latest_iteration(ctx["save"]))
            done = sum(a.killed is not None for a in attempts[:i])
            run_attempt(cfg, attempts[i], ctx, max(1, planned_kills - done), rng)
            print(soak_parts.attempt_line(attempts[i]), flush=True)
            i += 1
            if i > len(attempts) + 5:
                raise RuntimeError("the soak does not finish: see the logs in " + ctx["logs"])
        soak_seconds = time.perf_counter() - started
        final = os.path.join(str(work), "soak-final")
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(os.path.join(ctx["save"], tag_of(cfg.steps)), final)
    finally:
        soak_parts.unmount(str(work / "save-fs"), tmpfs)
    reference = soak_parts.reference_run(cfg, data, str(work), flags, launch, child_env)
    report = {"config": asdict(cfg), "tmpfs_save": tmpfs, "attempts": [asdict(a) for a in attempts],
              "enospc": ctx.get("enospc"), "soak_seconds": soak_seconds,
              "reference_seconds": reference["seconds"]}
    report["checkpoint"] = soak_compare.compare_checkpoints(final, reference["final"])
    report["tensorboard"] = soak_compare.compare_scalars(os.path.join(ctx["run_dir"], "tensorboard"),
                                                         reference["tensorboard"])
    report["jsonl"] = soak_compare.compare_jsonl(
        os.path.join(ctx["run_dir"], "tensorboard", "collapse_metrics.jsonl"),
        os.path.join(reference["tensorboard"], "collapse_metrics.jsonl"))
    report["bit_exact"] = soak_compare.bit_exact(report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="a fresh folder for the data, runs, logs")
    for name in ("steps", "layers", "kills-per-phase", "index-kills", "wall-kills", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(SoakConfig, name.replace("-", "_")))
    p.add_argument("--json", default=None, help="write the report here too")
    args = p.parse_args(argv)
    cfg = SoakConfig(args.work, args.steps, args.layers, args.kills_per_phase, args.index_kills,
                     args.wall_kills, seed=args.seed)
    report = run_soak(cfg)
    print(soak_parts.summary(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
