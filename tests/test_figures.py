"""Training-run figures from a synthetic collapse_metrics.jsonl (all files, non-empty PNGs, nulls)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from collapse_metrics.analysis.figures import plot_collapse_run
from collapse_metrics.analysis.runs import load_collapse_jsonl, summarize

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"fig3_alpha", "fig4_contraction", "fig5_grad_norms", "fig6_loss_vs_frequency", "tsim_heatmap"}


def synthetic_run(path: Path, layers: int = 6, steps: range = range(0, 101, 5),
                  transition: bool = True) -> Path:
    """A collapsing run: last-layer t_sim and loss jump at step 60, early-layer gradients vanish."""
    recs = []
    for step in steps:
        late = 1.0 / (1.0 + math.exp(-(step - 60) / 3.0))
        for layer in range(1, layers + 1):
            for sub in ("attn", "ffn"):
                t = min(1.0, 0.1 + 0.8 * late * layer / layers)
                r = 1.0 / (1.0 + 5 * late * layer / layers)
                alpha = None if step == 0 else 1.0 + late
                recs.append({
                    "step": step, "layer": layer, "sublayer": sub, "t_sim_x": t, "t_sim_y": t,
                    "t_sim_out": None if sub == "attn" and layer == 2 else t, "resid_norm": 10 / r,
                    "rms_factor_mean": r, "rms_factor_min": 0.8 * r, "rms_factor_max": 1.2 * r,
                    "alpha": alpha,
                    "c": None if alpha is None else alpha * r,
                    "grad_norm": None if step == 0 else 10 ** (-3 * late * (layers - layer) / layers),
                })
        recs.append({"step": step, "loss": 8.0 - 3 * step / 100 + 2 * late, "freq_loss_agg": 7.3,
                     "freq_loss_seq": None, "freq_loss_running": 7.0 + 0.003 * step,
                     "t_sim_embed": 0.01, "t_sim_head": None if step < 10 else 0.2 + 0.8 * late,
                     "transition": bool(transition and 60 <= step <= 65)})
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    return path


def test_loader_handles_nulls(tmp_path: Path) -> None:
    run = load_collapse_jsonl(synthetic_run(tmp_path / "m.jsonl"))
    assert list(run.layers) == [1, 2, 3, 4, 5, 6] and len(run.layer_steps) == 21
    assert np.isnan(run.layer["attn"]["alpha"][0]).all() and not np.isnan(run.layer["attn"]["alpha"][1]).any()
    assert np.isnan(run.layer["attn"]["t_sim_out"][:, 1]).all()
    assert np.isnan(run.step["freq_loss_seq"]).all()
    assert run.window(10) == (50.0, 75.0)
    assert load_collapse_jsonl(synthetic_run(tmp_path / "n.jsonl", transition=False)).window(10) == (0, 100)
    grads = run.layer_grad()
    assert np.isnan(grads[0]).all()
    np.testing.assert_allclose(grads[1], np.sqrt(2) * run.layer["attn"]["grad_norm"][1])
    run.layer["ffn"]["grad_norm_layer"][2] = 5.0  # the trainer's whole-layer norm wins where recorded
    np.testing.assert_allclose(run.layer_grad()[2], 5.0)


def test_all_figures_written(tmp_path: Path) -> None:
    jsonl = synthetic_run(tmp_path / "collapse_metrics.jsonl")
    pngs = plot_collapse_run(jsonl, tmp_path / "figs")
    assert set(pngs) == NAMES
    for png in pngs.values():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not [p for p in (tmp_path / "figs").iterdir() if p.name.startswith(".")]


def test_cli_and_sparse_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import plot_collapse

    run_dir = tmp_path / "tensorboard"
    run_dir.mkdir()
    (run_dir / "collapse_metrics.jsonl").write_text(  # only per-step records, mostly null
        json.dumps({"step": 1, "loss": None, "transition": None}) + "\n"
        + json.dumps({"step": 2, "loss": 5.0, "freq_loss_agg": None}) + "\n")
    ref = tmp_path / "freq.json"
    ref.write_text(json.dumps({"scope": "tokens", "num_tokens": 1000, "aggregated": 6.5}))
    argv = ["--run-dir", str(run_dir), "--out", str(tmp_path / "out"), "--frequency-json", str(ref),
            "--summary", str(tmp_path / "summary.json")]
    assert plot_collapse.main(argv) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["loss"] == 5.0
    assert {p.stem for p in (tmp_path / "out").glob("*.png")} == NAMES
    assert all(p.stat().st_size > 5_000 for p in (tmp_path / "out").glob("*.png"))
    assert plot_collapse.main(["--run-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


def test_summary_of_a_collapsed_run(tmp_path: Path) -> None:
    res = summarize(load_collapse_jsonl(synthetic_run(tmp_path / "m.jsonl")), last=3)
    assert res["freq_loss_agg"] == pytest.approx(7.3) and res["freq_loss_seq"] is None
    assert res["t_sim_last_layer"] == pytest.approx(0.9, abs=1e-3)
    assert res["grad_ratio_first_last"] < 1e-2 and res["last_step"] == 100


def test_figure_readability(tmp_path: Path) -> None:
    """Norm placement in every title, Fig 3 on a log scale, the c = 1 line in Fig 4's legend, Fig 2's
    legend says "adds" for a negative removed share."""
    from collapse_metrics.analysis.figures import _titled, alpha_label, fig_alpha, fig_contraction

    post = load_collapse_jsonl(synthetic_run(tmp_path / "post.jsonl"))
    assert post.norm_label == "Post-Norm"
    pre_path = tmp_path / "pre.jsonl"
    recs = [json.loads(line) for line in (tmp_path / "post.jsonl").read_text().splitlines() if line]
    pre_path.write_text("".join(json.dumps({**r, "t_sim_out": None} if "layer" in r else r) + "\n"
                                for r in recs))
    assert load_collapse_jsonl(pre_path).norm_label == "Pre-Norm"
    fig = _titled(fig_contraction(post, post.window(10)), post.norm_label)
    assert fig.get_suptitle().startswith("Post-Norm: steps")
    c_panel = fig.axes[1]
    assert "c = 1" in " ".join(t.get_text() for t in c_panel.get_legend().get_texts())
    assert all(ax.get_yscale() == "log" for ax in fig_alpha(post).axes[:2])
    assert alpha_label(0.5, -0.076) == "α=0.5 (adds 7.6%)"
    assert alpha_label(0.5, 0.2) == "α=0.5 (removes 20.0%)"
    assert alpha_label(1, None) == "α=1"


JUDGE_WITHOUT_MATPLOTLIB = """
import sys
sys.path.insert(0, sys.argv[2])
import stability_sweep  # the sweep tool's judge, imported as the tool runs it
from collapse_metrics.analysis.outcome import read_run, summarize as judge
from collapse_metrics.analysis.runs import load_collapse_jsonl, summarize
outcome = judge(read_run(sys.argv[1]), 7.3)
indicators = summarize(load_collapse_jsonl(sys.argv[1]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib")
assert not loaded, f"reading / judging a run imported {loaded[:3]}"
print(outcome.outcome, indicators["last_step"])
"""


@pytest.mark.integration
def test_reading_and_judging_a_run_imports_no_matplotlib(tmp_path: Path) -> None:
    """The JSONL reader (runs.py) and the outcome judge stay off matplotlib (only figures.py draws)."""
    from launch_utils import run

    path = synthetic_run(tmp_path / "m.jsonl")
    proc = run([sys.executable, "-c", JUDGE_WITHOUT_MATPLOTLIB, str(path), str(ROOT / "tools")])
    assert proc.stdout.split()[-1] == "100.0"
