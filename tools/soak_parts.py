"""The soak's pieces (tools/soak.py): the tiny corpus, the tmpfs ``--save`` and its full disk, the
wall-clock kill of a rank's process, the uninterrupted reference run and the report."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from typing import Any

import psutil

from megapost.checkpoint.folder import CheckpointFolder, iteration_of, tag_of

BALLAST = "ballast.bin"  # fills the tmpfs during the ENOSPC attempt
TMPFS_MB = 256


def make_data(root: str) -> dict[str, str]:
    """A synthetic corpus through the real path (SentencePiece tokenizer, preprocessing); reused."""
    from megapost.data import preprocess, train_tokenizer

    marker = os.path.join(root, "data.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            return json.load(f)
    os.makedirs(root, exist_ok=True)
    rng = random.Random(0)
    words = ("the farmer teacher captain river city council engineer student musician baker scientist "
             "built painted repaired discovered carried ordered visited measured bridge window boxes "
             "theory harvest letter stones concert garden road bread report bicycle yesterday morning "
             "storm market harbour midnight rain church sky").split()
    path = os.path.join(root, "corpus.jsonl")
    with open(path, "w") as f:
        for _ in range(300):
            text = ". ".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 14)))
                             for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"text": text}) + "\n")
    model = train_tokenizer([path], os.path.join(root, "tokenizer"), vocab_size=256, byte_fallback=False)
    stats = preprocess([path], output_prefix=os.path.join(root, "corpus"), tokenizer_model=model,
                       append_eod=True, progress=False, log=None)
    out = {"prefix": str(stats.outputs["text"]), "tokenizer": str(model)}
    with open(marker, "w") as f:
        json.dump(out, f)
    return out


def mount_tmpfs(path: str) -> bool:
    """A fresh tmpfs at ``path`` for --save when this process may mount (root); False otherwise."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "soak-save", path],
                        capture_output=True).returncode == 0
    return ok


def unmount(path: str, mounted: bool) -> None:
    if mounted:
        subprocess.run(["umount", "-l", path], capture_output=True)


def latest_iteration(save: str) -> int:
    """The iteration of the tag ``latest`` names (0: none)."""
    return iteration_of(CheckpointFolder(save).latest_name() or "") or 0


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def fill(path: str) -> int:
    """Write ``path`` until the filesystem is full (chunks of 1 MiB down to 4 KiB); returns its bytes."""
    chunk, size = 1 << 20, 0
    with open(path, "wb", buffering=0) as f:
        while chunk >= 4096:
            try:
                f.write(b"\0" * chunk)
                size += chunk
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    return size


def fill_disk(save: str, tmpfs: bool, save_interval: int) -> tuple[list[str], Any]:
    """The ENOSPC attempt's faults (tools/fault_pretrain.py) and watcher. On the tmpfs: the first save of
    the attempt pauses 4 s with its first file half written (``--slow-save``); once rank 0 has said it
    is saving in the background, the watcher fills the filesystem with a ballast file, and the
    background write goes on into a full disk. Without a tmpfs: the writer's fault (``--enospc 1``)."""
    if not tmpfs:
        return ["--enospc", "1"], None
    it = latest_iteration(save)
    iteration = it - it % save_interval + save_interval
    tag = tag_of(iteration)

    def watch(proc: subprocess.Popen, log: str) -> None:
        started = f"saving checkpoint (in the background) {os.path.join(save, tag)}"  # the 4 s pause begun
        while proc.poll() is None:
            with open(log, errors="replace") as f:
                if started in f.read():
                    break
            time.sleep(0.05)
        if proc.poll() is not None:
            return
        fill(os.path.join(os.path.dirname(save), BALLAST))

    return ["--slow-save", f"{iteration}:4"], watch


def empty_disk(save: str) -> None:
    path = os.path.join(os.path.dirname(save), BALLAST)
    if os.path.exists(path):
        os.unlink(path)


def enospc_facts(attempt: Any, text: str, save: str) -> dict[str, Any]:
    """What the ENOSPC attempt showed: its one-line error (how often printed), ``latest`` after it."""
    lines = [ln.strip() for ln in text.splitlines() if "not saved:" in ln]
    latest = CheckpointFolder(save).latest_name()
    return {"line": attempt.enospc_line, "printed": len(lines), "rc": attempt.rc,
            "latest_before": tag_of(attempt.resumed_from) if attempt.resumed_from else None,
            "latest_after": latest,
            "no_space": bool(attempt.enospc_line) and os.strerror(errno.ENOSPC).lower()[:8] in
            attempt.enospc_line.lower()}


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """The rank processes under the launcher: local rank -> pid."""
    out = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        ranks = [a.split("=", 1)[1] for a in cmd if a.startswith("--local_rank=")]
        if any(a.endswith("fault_pretrain.py") or a == "megapost.pretrain" for a in cmd) and ranks:
            out[int(ranks[0])] = child.pid
    return out


def wall_clock_kill(proc: subprocess.Popen, log: str, delay: float, rank: int) -> int | None:
    """Once training prints its first iteration line: wait ``delay`` s, SIGKILL ``rank``'s process."""
    while proc.poll() is None:
        with open(log, errors="replace") as f:
            if " iteration " in f.read():
                break
        time.sleep(0.2)
    time.sleep(delay)
    pid = rank_pids(proc).get(rank) if proc.poll() is None else None
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    return rank


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reference_run(cfg: Any, data: dict[str, str], work: str, flags: Any, launch: Any, child_env: Any
                  ) -> dict[str, Any]:
    """The same config, uninterrupted (async saves), in its own folders."""
    base = os.path.join(work, "reference")
    shutil.rmtree(base, ignore_errors=True)
    run_dir, save = os.path.join(base, "runs", "ref"), os.path.join(base, "ckpt")
    os.makedirs(run_dir, exist_ok=True)
    log = os.path.join(work, "logs", "reference.log")
    rc, seconds, _ = launch(flags(cfg, data, run_dir, save, True), log, child_env({}), None, cfg.timeout)
    if rc != 0:
        raise RuntimeError(f"the reference run failed ({rc}): see {log}")
    return {"seconds": seconds, "final": os.path.join(save, tag_of(cfg.steps)),
            "tensorboard": os.path.join(run_dir, "tensorboard")}


def attempt_line(a: Any) -> str:
    fault = {"enospc": "disk filled during an async write", "finish": "no fault"}.get(
        a.kind, f"kill rank {a.rank} in {a.kind}" + (f" (pass {a.hit})" if a.hit else ""))
    got = f"killed in {a.killed}" if a.killed else "no kill"
    mode = "async" if a.async_save else "sync"
    return (f"attempt {a.index:2d}: from iteration {a.resumed_from:3d}, {mode} saves, {fault}: exit {a.rc}, "
            f"{got}, {a.seconds:.1f} s")


def summary(report: dict[str, Any]) -> str:
    """The soak's report: kills by phase, restarts, ENOSPC, bit-exact, wall-time overhead."""
    attempts = report["attempts"]
    kills = Counter(a["killed"] for a in attempts if a["killed"])
    e, c, s, j = report["enospc"] or {}, report["checkpoint"], report["tensorboard"], report["jsonl"]
    overhead = report["soak_seconds"] / report["reference_seconds"] - 1
    by_phase = ", ".join(f"{k} {v}" for k, v in sorted(kills.items()))
    lines = [
        f"soak: {sum(kills.values())} kills survived ({by_phase}); "
        f"{len(attempts) - 1} restarts from 'latest' ({len(attempts)} launches)",
        f"ENOSPC ({'real full tmpfs' if report['tmpfs_save'] else 'fault injection'}): exit {e.get('rc')}, "
        f"printed {e.get('printed')}x: {e.get('line')}; latest {e.get('latest_before')} -> "
        f"{e.get('latest_after')}",
        f"checkpoint: {c['tensors']} tensors ({c['bytes']} bytes) {'equal' if not c['differ'] else 'DIFFER'}"
        f"{'' if not c['differ'] else ': ' + ', '.join(c['differ'][:8])}",
        f"TensorBoard: {s['tags']} scalar tags, {s['values']} values; {s['tags_bit_exact']} series "
        f"bit-exact, {len(s['wall_clock_tags'])} wall-clock series (steps only); duplicated "
        f"{s['duplicated'] or 'none'}, "
        f"missing {s['missing'] or 'none'}, extra {s['extra'] or 'none'}, differing {s['differ'] or 'none'}",
        f"JSONL: {j['lines']} lines ({j['steps']} steps) {'equal' if j['equal'] else 'DIFFER'} "
        f"(reference {j['reference_lines']})",
        f"bit-exact: {'yes' if report['bit_exact'] else 'NO'}; wall time {report['soak_seconds']:.0f} s vs "
        f"{report['reference_seconds']:.0f} s uninterrupted (overhead {100 * overhead:.0f}%, "
        f"{report['soak_seconds'] / len(attempts):.1f} s per launch)",
    ]
    return "\n".join(lines)
