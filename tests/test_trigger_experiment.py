"""tools/trigger_experiment.py end to end on the tiny corpus (a few steps): snapshots in the real
trainer, replays that reproduce the base exactly, replicas that differ by their data window, interventions
that act, the records, the summary, resuming, and a folder of another setting refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launch_utils import REPO, child_env

from megapost.study.trigger import read_records


def _run(tiny_data, out, *extra):
    cmd = [sys.executable, str(REPO / "tools" / "trigger_experiment.py"), "run", "--out", str(out),
           "--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model, "--hidden", "32",
           "--depth", "2", "--top-layers", "1", "--seq-length", "16", "--batch", "2", "--warmup", "2",
           "--lr", "0.01", "--snapshots", "4,6", "--replicas", "2", "--end-step", "12", "--feature-lag", "2",
           "--interval", "2", "--data-offset", "40", "--train-iters", "100", "--nice", "0",
           "--intervene-at", "6", "--interventions", "replay,wo_lr0.1,eps1e-6,freeze_gains,wo1_lr0.1", *extra]
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.integration
def test_replicas_replay_exactly_differ_by_data_and_interventions_act(tiny_data, tmp_path):
    out = tmp_path / "trigger"
    proc = _run(tiny_data, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(out / "replicas.jsonl")
    by = {(r["snapshot"], r["replica"], r["intervention"]): r for r in records}
    # base (replica 0 of both snapshots) + 1 control replay per snapshot + 2 replicas x 5 interventions
    assert len(records) == 2 + 2 + 10 and len(by) == len(records)
    for r in (0, 1):  # a replay from the snapshot reproduces the control to the last digit
        ctrl, replay = by[(6, r, "none")], by[(6, r, "replay")]
        assert (replay["final_loss"], replay["final_tsim"], replay["event"]) == \
            (ctrl["final_loss"], ctrl["final_tsim"], ctrl["event"])
        assert replay["features"] == ctrl["features"]
        for iv in ("wo_lr0.1", "eps1e-6", "freeze_gains", "wo1_lr0.1"):
            assert by[(6, r, iv)]["final_loss"] != ctrl["final_loss"], iv
        assert by[(6, r, "wo1_lr0.1")]["final_loss"] != by[(6, r, "wo_lr0.1")]["final_loss"]  # other layers
    assert by[(6, 1, "none")]["final_loss"] != by[(6, 0, "none")]["final_loss"]  # another data window
    assert by[(6, 1, "none")]["window_start"] == by[(6, 0, "none")]["window_start"] + 40 == 6 * 2 + 40
    assert by[(4, 1, "none")]["features"]["step"] == 6 and by[(4, 0, "none")]["features"]["step"] == 6
    feats = by[(6, 1, "none")]["features"]
    assert len(feats["resid"]) == len(feats["attn_s"]) == 2 and feats["attn_s_top"] == feats["attn_s"][-1]
    assert feats["adam_v_first"] > 0 and 0 <= feats["one_minus_tsim"] <= 1
    def rows(name):
        return [line.split(",") for line in (out / "series" / f"{name}.csv").read_text().splitlines()[1:]]

    base, own = rows("base"), rows("S6_r1_freeze_gains")
    last5 = [float(r[1]) for r in base if int(r[0]) in (4, 6)] + [float(r[1]) for r in own]  # steps 4-12
    treated = by[(6, 1, "freeze_gains")]
    assert treated["final_gap"] == pytest.approx(sum(last5) / 5 - treated["freq_loss"], abs=1e-5)
    series = (out / "series" / "S6_r1_freeze_gains.csv").read_text().splitlines()
    assert series[0] == "step,loss,t_sim_head,grad_ratio" and [int(s.split(",")[0]) for s in series[1:]] == \
        [8, 10, 12]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["snapshot"] for r in summary["decision"]] == [4, 6]
    assert {r["intervention"] for r in summary["rescues"]} == {"replay", "wo_lr0.1", "eps1e-6",
                                                              "freeze_gains", "wo1_lr0.1"}

    keep = tmp_path / "keep"
    rep = subprocess.run([sys.executable, str(REPO / "tools" / "trigger_experiment.py"), "report", str(out),
                          "--keep", str(keep)], cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert read_records(keep / "replicas.jsonl") == records
    assert (keep / "setting_trigger.json").is_file() and (keep / "series" / "base.csv").is_file()
    assert (keep / "summary.md").read_text() == (out / "summary.md").read_text()

    again = _run(tiny_data, out)  # resumed: nothing left to run, same records
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_records(out / "replicas.jsonl") == records
    other = _run(tiny_data, out, "--lr", "0.02")
    assert other.returncode == 2 and "setting.json: this folder was run with other lr" in other.stderr
