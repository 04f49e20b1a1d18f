"""tools/sweep_engine.py: the persistent engine (long-lived workers training run after run in-process)
gives bit-identical runs to one ``python -m megapost.pretrain`` process per run, and the adaptive seed
schedule stops a probe exactly when its majority vote is decided."""

from __future__ import annotations

import csv
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from launch_utils import REPO, child_env


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import sweep_engine

    return sweep_engine


def _vote_fixed(k: int, done: int, total: int) -> bool:
    """Brute force: every way the unfinished seeds can end gives the same vote (collapses: 2k >= total)."""
    votes = {2 * (k + extra) >= total for extra in range(total - done + 1)}
    return len(votes) == 1


def _fewest_to_decide(k: int, done: int, total: int) -> int:
    """Brute force: the fewest further results after which the vote can be fixed."""
    return next(m for m in range(total - done + 1)
                if any(_vote_fixed(k + c, done + m, total) for c in range(m + 1)))


@pytest.mark.parametrize("total", [1, 2, 3, 4, 5])
def test_adaptive_seeds_stop_exactly_when_the_vote_is_decided(engine, total):
    for done in range(total + 1):
        for k in range(done + 1):
            assert engine.decided(k, done, total) == _vote_fixed(k, done, total), (k, done, total)
            for running in range(total - done + 1):
                n = engine.seeds_to_launch(k, done, running, total)
                fewest = 0 if _vote_fixed(k, done, total) else _fewest_to_decide(k, done, total)
                want = max(0, fewest - running)
                assert n == min(want, total - done - running), (k, done, running, total)


def test_run_probes_runs_seeds_in_order_until_decided(engine):
    """A probe that collapses at every seed needs 2 of 3 seeds, one that never does 2, a split one 3."""
    fate = {"all": {1: True, 2: True, 3: True}, "none": {1: False, 2: False, 3: False},
            "split": {1: True, 2: False, 3: True}}
    ran = []

    def run_one(key, seed):
        ran.append((key, seed))
        return {"collapsed": fate[key][seed]}

    out = engine.run_probes({k: [1, 2, 3] for k in fate}, run_one, lambda r: r["collapsed"], 2, True)
    assert sorted(ran) == [("all", 1), ("all", 2), ("none", 1), ("none", 2), ("split", 1), ("split", 2),
                           ("split", 3)]
    assert [r["collapsed"] for r in out["split"]] == [True, False, True]
    full = engine.run_probes({"none": [1, 2, 3]}, run_one, lambda r: r["collapsed"], 2, False)
    assert len(full["none"]) == 3


def _sweep(tiny_data, out: Path, *extra: str) -> None:
    cmd = [sys.executable, str(REPO / "tools" / "stability_sweep.py"), "--out", str(out),
           "--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model, "--depths", "2",
           "--lrs", "0.1", "--warmups", "0", "--iters", "6", "--hidden", "32", "--seq-length", "16",
           "--batch", "2", "--interval", "1", "--seeds", "1,2", "--variants", "post,pre", "--nice", "0",
           *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.slow
def test_persistent_workers_give_the_runs_of_one_process_per_run(tiny_data, tmp_path):
    """4 cells (post/pre x 2 seeds) through one persistent worker (each run after another in the same
    process) and through one process per run: every cell's per-step metrics file is byte-identical
    (losses, t_sim, gradient norms at full precision), and so is every results.csv column but the timing
    and the engine's name. With --flush-denormal too."""
    for flush in ((), ("--flush-denormal",)):
        ref, fast = tmp_path / f"sub{len(flush)}", tmp_path / f"persistent{len(flush)}"
        _sweep(tiny_data, ref, "--engine", "subprocess", "--jobs", "2", *flush)
        _sweep(tiny_data, fast, "--engine", "persistent", "--jobs", "1", *flush)
        cells = sorted(p.name for p in (ref / "cells").iterdir())
        assert len(cells) == 4
        for cell in cells:
            jsonl = Path("tensorboard") / "collapse_metrics.jsonl"
            assert (fast / "cells" / cell / jsonl).read_bytes() == (ref / "cells" / cell / jsonl).read_bytes()
        rows = [list(csv.DictReader(open(d / "results.csv"))) for d in (ref, fast)]
        for a, b in itertools.zip_longest(*rows):
            assert (a["engine"], b["engine"]) == ("subprocess", "persistent")
            assert a["flush_denormal"] == b["flush_denormal"] == str(bool(flush))
            same = [k for k in a if k not in ("seconds", "engine")]
            assert {k: a[k] for k in same} == {k: b[k] for k in same}
            assert a["final_loss"] and a["outcome"] in {"collapsed", "plateau", "trained"}

