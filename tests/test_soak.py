"""The soak (tools/soak.py) at small size: 2 CPU ranks under DeepSpeed's launcher, a rank SIGKILLed in
each of forward, backward, the optimizer step, a synchronous save, an async write, evaluation, the data
index build and at a random wall-clock moment, the job relaunched from ``latest`` each time, the disk
filled once during an async write; the end state, every TensorBoard scalar series and the JSONL log
equal an uninterrupted run's bit for bit, each step once.

The default is the small soak (8 kills, ~10 launches; ~12 min on 2 busy cores);
``MEGAPOST_SOAK_FULL=1`` runs the issue's size (23 kills: 3 per step phase, 2 index builds, 3
wall-clock; ~35 min), as measured in docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch_utils import REPO, child_env, pretrain, tiny_model_flags

sys.path.insert(0, str(REPO / "tools"))
from soak_compare import scalar_events  # noqa: E402

PHASES = {"forward", "backward", "optimizer_step", "sync_save", "async_write", "eval", "index_build",
          "wall-clock"}


@pytest.mark.integration
@pytest.mark.slow
def test_soak_kills_anywhere_and_ends_bit_exact(tmp_path) -> None:
    full = os.environ.get("MEGAPOST_SOAK_FULL") == "1"
    size = [] if full else ["--steps", "24", "--kills-per-phase", "1", "--index-kills", "1",
                            "--wall-kills", "1"]
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "tools/soak.py", "--work", str(tmp_path / "soak"), "--json",
                           str(out), *size], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=3 * 3600)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    report = json.loads(out.read_text())
    if os.environ.get("MEGAPOST_SOAK_REPORT"):  # keep the measured report (docs/reliability.md)
        with open(os.environ["MEGAPOST_SOAK_REPORT"], "w") as f:
            f.write(out.read_text())
    attempts = report["attempts"]
    kills = [a for a in attempts if a["killed"]]
    assert {a["killed"] for a in kills} == PHASES, [a["killed"] for a in kills]
    assert len(kills) >= (20 if full else 8), len(kills)
    for a in kills:  # the planned kill fired (a real SIGKILL: the launcher reports the rank's -9)
        assert a["killed"] == a["kind"] and a["rc"] != 0, a
    steps = report["config"]["steps"]
    assert attempts[-1]["rc"] == 0 and attempts[-1]["kind"] == "finish", attempts[-1]
    e = report["enospc"]
    assert e["rc"] != 0 and e["no_space"] and e["latest_after"] == e["latest_before"], e
    assert e["line"].startswith("error: checkpoint iter_") and "'latest' still names " + e["latest_before"] \
        in e["line"], e
    following = attempts[[a["kind"] for a in attempts].index("enospc") + 1]
    assert f"iter_{following['resumed_from']:07d}" == e["latest_before"]  # and it went on from there
    assert not report["checkpoint"]["differ"] and report["checkpoint"]["tensors"] > 0, report["checkpoint"]
    tb = report["tensorboard"]
    assert not (tb["duplicated"] or tb["missing"] or tb["extra"] or tb["differ"]), tb
    assert tb["lm_loss_steps"] == list(range(1, steps + 1))  # every step once, independent of the reference
    assert report["jsonl"]["equal"] and report["jsonl"]["steps"] == steps, report["jsonl"]
    assert report["bit_exact"] and proc.returncode == 0


@pytest.mark.integration
@pytest.mark.slow
def test_a_kill_after_a_save_loses_no_tensorboard_step(tiny_data, tmp_path) -> None:
    """Steps 1-3 are saved at 3 but logged only at 4: a rank SIGKILLed in step 4's forward (a real kill
    point) must still leave them in TensorBoard (the save writes and flushes them), and the resumed run
    writes 4-6: every step of every series exactly once."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 6, "--log-interval": 4, "--save-interval": 3,
                                           "--save": ckpt, "--tensorboard-dir": tb})
    killed = pretrain(flags, check=False, faults=["--kill-point", "forward:7:0"])  # 2 micro-batches a step
    assert killed.returncode == -9 and "in forward (pass 7)" in killed.stderr, killed.stderr[-2000:]
    assert (ckpt / "latest").read_text() == "iter_0000003"
    pretrain([*flags, "--load", str(ckpt)])
    events = scalar_events(str(tb))
    for tag in ("train/lm_loss", "train/lr", "train/grad_norm"):
        assert {s: len(v) for s, v in events[tag].items()} == {s: 1 for s in range(1, 7)}, (tag, events[tag])
    assert sorted(events["train/skipped_iterations"]) == [4, 6]


def test_the_enospc_attempt_waits_for_a_complete_tag() -> None:
    import soak

    def kinds(latest: int, order: list[str], i: int) -> list[str]:
        attempts = [soak.Attempt(n, k, 0, False) for n, k in enumerate(order)]
        soak._defer_enospc(attempts, i, latest)
        assert [a.index for a in attempts] == list(range(len(order)))
        return [a.kind for a in attempts]

    order = ["forward", "enospc", "eval", "finish"]
    assert kinds(0, order, 1) == ["forward", "eval", "enospc", "finish"]  # no tag yet: one attempt later
    assert kinds(4, order, 1) == order  # a tag exists: 'latest' must stay on it
    assert kinds(0, ["enospc", "finish"], 0) == ["enospc", "finish"]  # never after the final attempt
