"""The early warning (collapse_metrics/early_warning.py) and --collapse-guard (guard.py, the Trainer's
snapshot/restore hook): replay with a known lead, a healthy Pre-Norm run that must not warn, a real
rollback that restores the exact state, and bounded retries."""

from __future__ import annotations

import json
import math

import pytest
from collapse_metrics.analysis.outcome import read_run, summarize
from collapse_metrics.early_warning import EarlyWarning, first_warning
from collapse_metrics.guard import Remedy
from launch_utils import pretrain, read_scalars, tiny_model_flags

from megapost.config.errors import ConfigError


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _guard(remedy: str) -> dict:
    return {"--collapse-guard": True, "--collapse-guard-remedy": remedy, "--collapse-guard-retries": 1,
            "--collapse-guard-interval": 2}


def _run(tiny_data, out, norm: str = "post", check: bool = True, **extra):
    """The 12-layer lr 0.1 config of test_collapse_alarm.py: Post-Norm collapses within ~8 steps."""
    flags = tiny_model_flags(tiny_data, **{
        "--norm-position": norm, "--num-layers": 12, "--hidden-size": 32, "--ffn-hidden-size": 96,
        "--micro-batch-size": 4, "--global-batch-size": 4, "--train-iters": 12, "--lr": 0.1, "--min-lr": 0.1,
        "--lr-warmup-iters": 0, "--init-variance": "paper", "--seed": 1, "--log-interval": 100,
        "--tensorboard-dir": out, "--plugins": "collapse_metrics", "--collapse-interval": 1, **extra})
    return pretrain(flags, check=check)


def test_early_warning_replay_known_lead(tmp_path):
    # a synthetic Post-Norm run: the deepest residual norm sits at 8, dips to 6, then grows from step 40;
    # t_sim(X^H) jumps at step 80 and the gradients vanish (the alarm)
    path = tmp_path / "collapse_metrics.jsonl"
    lines = []
    for step in range(4, 121, 4):
        resid = 6.0 if step == 8 else 8.0 * (1.1 ** max(0, (step - 40) // 4))
        collapsed = step >= 80
        for layer in (1, 2):
            for sub in ("attn", "ffn"):
                lines.append({"step": step, "layer": layer, "sublayer": sub, "t_sim_out": 0.1,
                              "resid_norm": resid if layer == 2 else 8.0,
                              "grad_norm_layer": (1e-9 if collapsed and layer == 1 else 1.0)})
        lines.append({"step": step, "loss": 7.0 if collapsed else 5.0,
                      "t_sim_head": 1.0 if collapsed else 0.2})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    outcome = summarize(read_run(path), 7.0)
    # the first step with 8 * 1.1^k >= 4 * 6 (the minimum, at step 8): k >= log(3) / log(1.1)
    expected = 40 + 4 * math.ceil(math.log(3) / math.log(1.1))
    assert outcome.warning_step == expected and outcome.alarm_step == 80 and outcome.transition_step == 80
    assert first_warning([(4, 8.0), (8, 31.0)]) is None and first_warning([(4, 8.0), (8, 32.0)]) == 8
    warning = EarlyWarning(2.0)
    assert warning.update(1, 5.0) == (False, None)
    warned, line = warning.update(2, 10.0)
    assert warned and line.startswith("[collapse] EARLY WARNING at step 2")
    assert warning.update(3, 50.0) == (True, None)  # latched: one line


def test_remedy_parsing():
    assert Remedy.parse("lr*0.5") == Remedy("lr", 0.5) and Remedy.parse("warmup") == Remedy("warmup", 2.0)
    assert Remedy.parse("rewarm") == Remedy("rewarm", 0.1, 0) and Remedy.parse("rewarm*0.2/30") == \
        Remedy("rewarm", 0.2, 30) and Remedy.parse("warmup-restart*0.5") == Remedy("rewarm", 0.5, 0)
    for bad in ("rewarm*0", "rewarm*1.5", "rewarm/3", "rewarm*x/3"):
        with pytest.raises(ConfigError, match="rewarm"):
            Remedy.parse(bad)
    assert Remedy.parse("warmup*3") == Remedy("warmup", 3.0) and Remedy.parse("skip").kind == "skip"
    with pytest.raises(ConfigError, match="--collapse-guard-remedy 'lr/2'"):
        Remedy.parse("lr/2")


@pytest.mark.integration
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_run_does_not_warn(tiny_data, tmp_path, norm):
    """Pre-Norm: the warning is off (its residual stream grows by design); a healthy Post-Norm run is
    read by the rule (field False, not null) and not warned."""
    proc = _run(tiny_data, tmp_path, norm=norm, **{"--num-layers": 2, "--lr": 3e-3, "--min-lr": 3e-4,
                                                   "--lr-warmup-iters": 2, "--collapse-early-warning": True})
    steps = [r for r in _records(tmp_path / "collapse_metrics.jsonl") if "loss" in r]
    assert steps and not any(r["early_warning"] for r in steps)
    assert "EARLY WARNING" not in proc.stdout + proc.stderr
    if norm == "pre":
        assert "early warning off" in proc.stdout
    else:
        assert all(r["early_warning"] is False for r in steps)
        assert not read_scalars(tmp_path, "collapse/alarm/early_warning_at_step")  # never went on


@pytest.mark.integration
def test_guard_rolls_back_exactly_and_retries_are_bounded(tiny_data, tmp_path):
    # remedy lr*1 (none): after the rollback the run replays bit for bit, collapses at the same step,
    # and with --collapse-guard-retries 1 the second alarm stops it with one line
    out = tmp_path / "same"
    proc = _run(tiny_data, out, check=False, **_guard("lr*1"))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    recs = _records(out / "collapse_metrics.jsonl")
    guard = [r["guard"] for r in recs if "guard" in r]
    assert len(guard) == 1, log
    alarm, back = guard[0]["step"], guard[0]["to_step"]
    assert back < alarm and alarm - back >= 2
    assert f"[collapse] guard: COLLAPSED at step {alarm}; rolled back to step {back} (rollback 1/1)" in log
    assert f"[collapse] guard: COLLAPSED at step {alarm} after 1 rollback(s) (--collapse-guard-retries 1); " \
           "stopping" in log
    cut = recs.index(next(r for r in recs if "guard" in r))
    before = {r["step"]: r for r in recs[:cut] if "loss" in r}
    after = {r["step"]: r for r in recs[cut:] if "loss" in r}
    assert sorted(after) == list(range(back + 1, alarm + 1))
    for step in after:  # the restored parameters, optimizer state, schedule and data position are exact
        assert after[step]["loss"] == before[step]["loss"] and after[step]["t_sim_head"] == \
            before[step]["t_sim_head"], step
    assert read_scalars(out, "collapse/guard/rollbacks") == {alarm: 1.0}


def _split_at_rollback(recs: list[dict]) -> tuple[dict, dict, dict]:
    cut = recs.index(next(r for r in recs if "guard" in r))
    return (recs[cut]["guard"], {r["step"]: r for r in recs[:cut] if "loss" in r},
            {r["step"]: r for r in recs[cut:] if "loss" in r})


@pytest.mark.integration
def test_guard_remedy_changes_the_rerun(tiny_data, tmp_path):
    out = tmp_path / "lr"
    proc = _run(tiny_data, out, check=False, **_guard("lr*0.1"))
    guard, before, after = _split_at_rollback(_records(out / "collapse_metrics.jsonl"))
    assert guard["lr"] == pytest.approx(0.01), proc.stdout + proc.stderr
    back = guard["to_step"]
    # the first step after the rollback sees the snapshot's parameters (its loss is computed before the
    # update): equal; the next one follows a 10x smaller update: different
    assert after[back + 1]["loss"] == before[back + 1]["loss"]
    assert after[back + 2]["loss"] != before[back + 2]["loss"]


def test_rewarm_scale_and_schedule():
    import torch

    from megapost.optim.schedule import WarmupDecaySchedule, rewarm_scale

    assert rewarm_scale(9, (10, 4, 0.2)) == 1.0 and rewarm_scale(10, (10, 4, 0.2)) == pytest.approx(0.2)
    assert rewarm_scale(12, (10, 4, 0.2)) == pytest.approx(0.2 + 0.8 * 2 / 4)
    assert rewarm_scale(20, (10, 4, 0.2)) == 1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupDecaySchedule(opt, 1.0, 0.0, 0, 100, "linear")
    sched.rewarm = (5, 10, 0.1)
    for _ in range(7):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx((1 - 7 / 100) * (0.1 + 0.9 * 2 / 10))


@pytest.mark.integration
def test_guard_rewarm_ramps_the_lr_from_the_rollback(tiny_data, tmp_path):
    """rewarm*0.1/4 at constant lr 0.1: the re-run steps train at 0.01, 0.0325, 0.055, 0.0775, then 0.1."""
    out = tmp_path / "rewarm"
    proc = _run(tiny_data, out, check=False, **_guard("rewarm*0.1/4"), **{"--log-interval": 1})
    log = proc.stdout + proc.stderr
    guard, before, after = _split_at_rollback(_records(out / "collapse_metrics.jsonl"))
    back = guard["to_step"]
    assert "lr re-warmed from x0.1 over 4 steps" in log, log[-3000:]
    lrs = read_scalars(out, "train/lr")
    rerun = sorted(after)
    assert len(rerun) >= 3, log[-3000:]
    for step in rerun:  # the lr each re-run step trained at (TensorBoard keeps the re-run's value)
        j = step - back - 1
        assert lrs[step] == pytest.approx(0.1 * (0.1 + 0.9 * min(1.0, j / 4)), rel=1e-6), step
    assert lrs[back] == pytest.approx(0.1)
    assert after[back + 1]["loss"] == before[back + 1]["loss"]
    assert after[back + 2]["loss"] != before[back + 2]["loss"]


@pytest.mark.integration
def test_guard_skip_moves_on_in_the_data(tiny_data, tmp_path):
    out = tmp_path / "skip"
    proc = _run(tiny_data, out, check=False, **_guard("skip"))
    log = proc.stdout + proc.stderr
    guard, before, after = _split_at_rollback(_records(out / "collapse_metrics.jsonl"))
    assert "data window skipped" in log and guard["lr"] == pytest.approx(0.1)
    # same parameters as before the first re-run step, but the next batch, not the replayed one
    assert after[guard["to_step"] + 1]["loss"] != before[guard["to_step"] + 1]["loss"]


@pytest.mark.integration
def test_guard_refuses_zero1(tiny_data, tmp_path):
    proc = _run(tiny_data, tmp_path, check=False, **{"--collapse-guard": True, "--zero-stage": 1})
    assert proc.returncode != 0
    assert "error: --collapse-guard: in-memory snapshots are exact only for --zero-stage 0 in fp32" \
        in proc.stderr
