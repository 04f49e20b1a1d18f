"""tools/stability_sweep.py on the tiny corpus: a 1-cell x 2-variant grid through the real trainer writes the
CSV, the phase diagram and the alarm scores; a rerun skips the finished cells (resumable). A variant is a
placement plus trainer flags (``post+qk-norm``), checked against the trainer's parser.
tools/placement_table.py turns finished sweeps into the comparison table + figure;
examples/placement_study.sh runs both."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys

import pytest
from collapse_metrics.plugin import CollapseMetricsPlugin
from launch_utils import REPO, child_env, run

from megapost.config.arguments import parse_args

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sweep_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import stability_sweep

    return stability_sweep


def _sweep(tiny_data, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "stability_sweep.py"), "--out", str(out),
           "--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model, "--depths", "2",
           "--lrs", "0.1", "--warmups", "0", "--iters", "4", "--hidden", "32", "--seq-length", "16",
           "--batch", "2", "--interval", "1", "--jobs", "2", "--nice", "0", *extra]
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)


def test_variants_are_parsed_and_reach_the_trainer(sweep_module, tmp_path) -> None:
    parse = sweep_module.parse_variant
    assert parse("post") == sweep_module.Variant("post", "post", ())
    assert parse("post+qk-norm").flags == ("--qk-norm",)
    assert parse("post+z-loss=1e-4") == sweep_module.Variant("post+z-loss=1e-4", "post", ("--z-loss", "1e-4"))
    assert parse("mix+mix-post-fraction=0.5+qk-norm").flags == ("--mix-post-fraction", "0.5", "--qk-norm")
    errors = {"postt": "'postt' starts with 'postt', not a placement; choose from post, pre,",
              "post+qk-norm=1": "--qk-norm takes no value: write +qk-norm",
              "post+z-loss": "--z-loss takes a value: write +z-loss=VALUE",
              "post+z-loss=abc": "'abc' is not a valid value for --z-loss",
              "post+no-such-flag": "--no-such-flag is not a megapost.pretrain flag",
              "post+norm-position=pre": "--norm-position is not a megapost.pretrain flag"}
    for text, message in errors.items():
        with pytest.raises(SystemExit, match=f"^error: --variants: {re.escape(repr(text))}") as err:
            parse(text)
        assert message in str(err.value)
    # the argv of each cell, parsed by the trainer's own parser
    args = sweep_module.build_parser().parse_args(
        ["--out", str(tmp_path), "--data-path", "d", "--tokenizer-model", "t", "--variants",
         "post+qk-norm,post+z-loss=1e-4,dyt"])
    args.extra = ["--collapse-guard"]
    assert [v.name for v in args.variants] == ["post+qk-norm", "post+z-loss=1e-4", "dyt"]
    seen = {}
    for v in args.variants:
        cell = sweep_module.Cell(v.name, 2, 0.1, 0, 1)
        seen[v.name] = parse_args(sweep_module.cell_argv(args, cell, tmp_path / cell.name),
                                  [CollapseMetricsPlugin])
    assert (seen["post+qk-norm"].norm_position, seen["post+qk-norm"].qk_norm, seen["post+qk-norm"].z_loss) \
        == ("post", True, 0.0)
    assert (seen["post+z-loss=1e-4"].qk_norm, seen["post+z-loss=1e-4"].z_loss) == (False, 1e-4)
    assert seen["dyt"].norm_position == "dyt" and seen["dyt"].collapse_guard


@pytest.mark.integration
def test_sweep_writes_results_and_resumes_and_the_table(tiny_data, tmp_path) -> None:
    sweep = tmp_path / "sweep"
    proc = _sweep(tiny_data, sweep, "--variants", "post+qk-norm,pre")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "results.csv")))
    assert [(r["variant"], r["placement"]) for r in rows] == [("post+qk-norm", "post"), ("pre", "pre")]
    for r in rows:
        assert r["outcome"] in {"collapsed", "trained", "plateau"} and r["depth"] == "2"
        assert float(r["final_tsim"]) > 0 and r["final_grad_ratio"] and float(r["freq_loss"]) > 0
        # 4 steps from the initial loss (above L) cannot come 0.3 nats below L: failed to start, no step
        assert (r["event"], r["event_step"], r["learned_step"], r["decay_style"]) == (
            "failed_to_start", "", "", "cosine")
    assert (sweep / "phase_L2.png").read_bytes()[:8] == PNG
    assert (sweep / "prob_L2.png").read_bytes()[:8] == PNG and "progress 2/2 cells (2 run now" in proc.stdout
    assert len(json.loads((sweep / "cells.json").read_text())) == 2 and (sweep / "warning.json").is_file()
    scores = json.loads((sweep / "alarm.json").read_text())
    assert {"recall", "precision", "alarm_minus_transition"} <= set(scores)
    cells = sorted(p.name for p in (sweep / "cells").iterdir())
    assert cells == ["post+qk-norm_L2_lr0.1_w0_s1", "pre_L2_lr0.1_w0_s1"]
    trained = {c: json.loads((sweep / "cells" / c / "tensorboard" / "args.json").read_text()) for c in cells}
    models = {c: trained[c]["model"] for c in cells}
    assert models[cells[0]]["qk_norm"] is True and models[cells[0]]["norm_position"] == "post"
    assert models[cells[1]]["qk_norm"] is False and models[cells[1]]["norm_position"] == "pre"
    logs = {c: (sweep / "cells" / c / "train.log").stat().st_mtime_ns for c in cells}
    again = _sweep(tiny_data, sweep, "--norms", "post+qk-norm,pre")  # finished cells are not rerun
    assert again.returncode == 0 and "[sweep] 2/2 cells" in again.stdout
    assert {c: (sweep / "cells" / c / "train.log").stat().st_mtime_ns for c in cells} == logs
    refused = _sweep(tiny_data, tmp_path / "other", "--", "--lr-decay-style", "constant")
    assert refused.returncode != 0 and "--lr-decay-style after '--'" in refused.stderr + refused.stdout

    out = tmp_path / "table" / "study"
    table = run([sys.executable, "tools/placement_table.py", "--sweep", f"tiny={sweep}", "--sweep",
                 f"again={sweep}", "--out", str(out)])
    md = (tmp_path / "table" / "study.md").read_text()
    assert md in table.stdout  # (after any import-time warning line of DeepSpeed)
    assert md.startswith("| config | variant | outcome | final loss | L | gap |")
    table_rows = list(csv.DictReader(open(tmp_path / "table" / "study.csv")))
    assert [(r["config"], r["variant"]) for r in table_rows] == [
        ("tiny", "post+qk-norm"), ("tiny", "pre"), ("again", "post+qk-norm"), ("again", "pre")]
    for t, r in zip(table_rows, rows + rows, strict=True):
        gap = pytest.approx(float(r["final_gap"]), rel=1e-5)  # the table: 6 digits
        assert t["outcome"] == r["outcome"] and float(t["final_gap"]) == gap
        final = float(r["final_gap"]) + float(r["freq_loss"])
        assert float(t["final_loss"]) == pytest.approx(final, abs=1e-3)
        assert float(t["final_tsim"]) == pytest.approx(float(r["final_tsim"]), rel=1e-3)
        assert f"| tiny | `{r['variant']}` | {r['outcome']} | {float(t['final_loss']):.2f} |" in md
        assert (t["alarm_step"] or None) == (r["alarm_step"] or None)
    assert (tmp_path / "table" / "study.png").read_bytes()[:8] == PNG
    probs = (tmp_path / "table" / "study_probabilities.md").read_text()
    assert "| tiny | post+qk-norm | 2 | 0.1 | 0 | 1 |" in probs and "(1/1)" in probs
    bad = run([sys.executable, "tools/placement_table.py", "--sweep", str(sweep), "--out", str(out)],
              check=False)
    assert bad.returncode == 2 and "write NAME=DIR" in bad.stderr


@pytest.mark.integration
def test_placement_study_script_smoke(tiny_data, tmp_path) -> None:
    """examples/placement_study.sh at tiny sizes (toy configuration only, one variant)."""
    out = tmp_path / "fig" / "study"
    run(["bash", "examples/placement_study.sh"], DATA=tiny_data.prefix, TOKENIZER=tiny_data.tokenizer_model,
        RUN_ROOT=str(tmp_path / "runs"), OUT=str(out), VARIANTS="post+z-loss=1e-4", DELAYED_VARIANTS="",
        LAYERS="2", HIDDEN="32", SEQ="16", BATCH="2", ITERS="3", K="1", JOBS="1")
    cell = tmp_path / "runs" / "toy" / "cells" / "post+z-loss=1e-4_L2_lr0.01_w0_s1234"
    assert json.loads((cell / "tensorboard" / "args.json").read_text())["optimizer"]["z_loss"] == 1e-4
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [(r["config"], r["variant"]) for r in rows] == [("toy", "post+z-loss=1e-4")]
    assert math.isfinite(float(rows[0]["final_loss"]))
    assert "| toy | `post+z-loss=1e-4` |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == PNG
