"""Golden runs for refactors: three real launches whose losses, grad norms and collapse metrics must
not change when code only moves (issue 17). Run from a checkout's root:

    python benchmarks/golden/record.py OUT.json            # record (the three launches, ~3-4 min)
    python benchmarks/golden/record.py OUT.json --compare benchmarks/golden/golden.json
    python benchmarks/golden/record.py OUT.json --base REV  # against REV recorded here, now (~2x the time)

CPUs round differently (oneDNN/MKL pick other kernels on AMX, AVX-512 or AVX2), so a recording compares
bit for bit only with one made on the same kind of CPU. Each recording writes ``OUT.machine.json`` (the
CPU) beside it; ``--compare`` names both CPUs when they differ, and ``--base REV`` records REV (a git
worktree, its own ``megapost`` first on PYTHONPATH) on this machine and compares against that instead.

Runs (all through the user's commands, with the collapse_metrics plugin at --log-interval 1):
  post40   bash examples/pretrain_postnorm.sh --train-iters 40            (the headline run, 1 rank)
  tp2sp_pp2 deepspeed --num_gpus 4 ... TP2 + SP x PP2, 8 steps
  dp2_z2_bf16 deepspeed --num_gpus 2 ... ZeRO-2, --bf16, 6 steps
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "post40": (["bash", "examples/pretrain_postnorm.sh"], ["--train-iters", "40"]),
    "tp2sp_pp2": (["deepspeed", "--num_gpus", "4", "--master_port", "29611", "examples/pretrain_postnorm.sh"],
                  ["--train-iters", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--pipeline-model-parallel-size", "2", "--collapse-interval", "2"]),
    "dp2_z2_bf16": (["deepspeed", "--num_gpus", "2", "--master_port", "29612",
                     "examples/pretrain_postnorm.sh"],
                    ["--train-iters", "6", "--zero-stage", "2", "--bf16", "--collapse-interval", "2"]),
}
COMMON = ["--log-interval", "1", "--eval-interval", "0", "--save-interval", "0"]


def scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of every event file under ``tb_dir``: tag -> {step: value} (skip timing tags)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        rel = events.parent.relative_to(tb_dir).as_posix()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith(("throughput", "time")) or "tokens_per_sec" in tag or "mfu" in tag:
                continue
            key = tag if rel == "." else f"{rel}:{tag}"
            out[key] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def jsonl_rows(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.rglob("collapse_metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.append({k: v for k, v in row.items() if not k.startswith(("time", "wall"))})
    return rows


def machine() -> dict[str, str]:
    """The CPU whose kernels produced a recording: model name and the SIMD features that pick them."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    simd = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return {"cpu": model, "simd": ",".join(simd) or "none"}


def _machine_file(recording: Path) -> Path:
    return recording.with_name(recording.stem + ".machine.json")


def record(out: Path, checkout: Path | None = None) -> dict:
    """The three runs of ``checkout`` (default: this one) written to ``out`` with its machine file."""
    result = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if checkout is not None:  # its megapost before the installed one
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    for name, (cmd, flags) in RUNS.items():
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            env["MEGAPOST_RUN_DIR"] = tmp
            proc = subprocess.run(cmd + flags + COMMON + ["--run-name", name], env=env, text=True,
                                  capture_output=True, timeout=1200, cwd=checkout)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            run_dir = Path(tmp) / name
            result[name] = {"scalars": scalars(run_dir / "tensorboard"), "jsonl": jsonl_rows(run_dir)}
            print(f"{name}: {len(result[name]['scalars'])} tags, {len(result[name]['jsonl'])} jsonl rows")
    out.write_text(json.dumps(result, indent=0, sort_keys=True))
    _machine_file(out).write_text(json.dumps(machine(), indent=1) + "\n")
    return result


def record_base(rev: str, out: Path) -> dict:
    """``rev``'s three runs on this machine, from a temporary git worktree (removed after)."""
    with tempfile.TemporaryDirectory(prefix="golden-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            print(f"base {rev}:")
            return record(out, checkout=tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)


def machine_note(reference: Path) -> str | None:
    """One line when ``reference`` was recorded on another kind of CPU than this one, else None."""
    path = _machine_file(reference)
    if not path.exists():
        return f"note: {path} is missing: the CPU that recorded {reference} is unknown"
    then, now = json.loads(path.read_text()), machine()
    if then == now:
        return None
    return (f"note: {reference} was recorded on {then['cpu']} ({then['simd']}); this machine is {now['cpu']} "
            f"({now['simd']}): CPU kernels round differently, so values may differ without a code change; "
            f"compare against the base commit recorded here: --base REV")


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def compare(new: dict, old: dict) -> int:
    """Print the number of values compared, exact matches, and the largest relative difference."""
    a, b = dict(_flatten(new)), dict(_flatten(old))
    missing, extra = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
    worst, diffs = 0.0, []
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float) and not (math.isnan(x) and math.isnan(y)):
            if x != y:
                rel = abs(x - y) / max(abs(y), 1e-30)
                worst = max(worst, rel)
                diffs.append((rel, k, x, y))
        elif x != y and not (isinstance(x, float) and isinstance(y, float)):
            diffs.append((math.inf, k, x, y))
    print(f"compared {len(a.keys() & b.keys())} values: {len(diffs)} differ, max rel diff {worst:.3g}; "
          f"missing {len(missing)}, new {len(extra)}")
    for d in sorted(diffs, reverse=True)[:15]:
        print("  ", d)
    for k in missing[:10]:
        print("   missing", k)
    return 1 if diffs or missing else 0


def main(argv: list[str]) -> int:
    target = Path(argv[0])
    if "--base" in argv:
        base = record_base(argv[argv.index("--base") + 1], target.with_name(target.stem + ".base.json"))
        print("this checkout:")
        return compare(record(target), base)
    new = record(target)
    if "--compare" not in argv:
        return 0
    reference = Path(argv[argv.index("--compare") + 1])
    status = compare(new, json.loads(reference.read_text()))
    if (note := machine_note(reference)) is not None:
        print(note)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
