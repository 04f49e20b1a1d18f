"""Run the real trainer in subprocesses (plain python or DeepSpeed's launcher) and read its logs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dist_utils import free_port

REPO = Path(__file__).resolve().parent.parent


def tiny_model_flags(data, **overrides) -> list[str]:
    """A model and batch small enough for a 2-core CPU, on the ``tiny_data`` fixture."""
    flags = {
        "--data-path": data.prefix, "--tokenizer-model": data.tokenizer_model, "--num-layers": 2,
        "--hidden-size": 64, "--ffn-hidden-size": 128, "--num-attention-heads": 4, "--seq-length": 32,
        "--micro-batch-size": 2, "--global-batch-size": 4, "--train-iters": 6, "--lr": 3e-3,
        "--lr-warmup-iters": 2, "--log-interval": 1, "--eval-interval": 0, "--seed": 7,
    }
    flags.update(overrides)
    out: list[str] = []
    for key, value in flags.items():
        if value is True:
            out.append(key)
        elif value is not None and value is not False:
            out += [key, str(value)]
    return out


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def run(cmd: Sequence[str], timeout: float = 600, check: bool = True,
        **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), cwd=REPO, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


FAULT_PRETRAIN = "tools/fault_pretrain.py"  # megapost.pretrain with a harness's FaultInjector


def pretrain(flags: Sequence[str], nprocs: int = 1, fail_rank: str | None = None, faults: Sequence[str] = (),
             **kw) -> subprocess.CompletedProcess:
    """``python -m megapost.pretrain`` for one rank, DeepSpeed's launcher for more; with ``faults`` (the
    FAULTS flags of tools/fault_pretrain.py) or ``fail_rank`` ("RANK:ITERATION": that rank raises before
    that iteration) through that harness."""
    fault = [*(["--fail-rank", fail_rank] if fail_rank is not None else []), *faults]
    entry = [FAULT_PRETRAIN, *fault] if fault else []
    if nprocs == 1:
        return run([sys.executable, *(entry or ["-m", "megapost.pretrain"]), *flags], **kw)
    return run(["deepspeed", "--num_gpus", str(nprocs), "--master_port", str(free_port()),
                *(entry or ["--module", "megapost.pretrain"]), *flags], **kw)


def read_scalars(tb_dir: str | Path, tag: str) -> dict[int, float]:
    """All values of one TensorBoard scalar tag, keyed by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in acc.Scalars(tag)}


def scalar_tags(tb_dir: str | Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])
