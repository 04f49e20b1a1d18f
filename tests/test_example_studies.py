"""The study examples start and finish their first step at tiny settings (the real tools and trainer):
examples/scaling_study.sh's boundary part (tools/collapse_boundary.py) and
examples/collapse_factor_study.sh's one-sweep part. Each bracket is held to two 2-step probes (one seed,
no bisection): neither end collapses in 2 steps, and widening the top end passes --lr-max."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
from launch_utils import REPO, run

pytestmark = pytest.mark.integration  # every test here starts the trainer

TINY = ["--seq-length", "16", "--batch", "2", "--iters", "2", "--interval", "1", "--seeds", "1",
        "--bisect-steps", "0", "--warmup", "0", "--jobs", "1", "--heads", "2"]
BRACKET = ["--lr-lo", "1e-3", "--lr-hi", "1e-2", "--lr-min", "1e-3", "--lr-max", "1e-2"]


def _two_probes(sweep: Path, lrs: list[float]) -> None:
    rows = list(csv.DictReader(open(sweep / "results.csv")))
    assert sorted(float(r["lr"]) for r in rows) == pytest.approx(lrs)
    assert all(r["train_iters"] == "2" and r["width"] == "32" for r in rows)


def test_scaling_study_boundary_part(tiny_data, tmp_path) -> None:
    runs = tmp_path / "runs"
    out = run(["bash", "examples/scaling_study.sh"], CORPUS=tiny_data.prefix,
              TOKENIZER=tiny_data.tokenizer_model, RUNS=str(runs), PARTS="boundary", JOBS="1",
              BOUNDARY_FLAGS=" ".join(["--widths", "32", "--depths", "2", *TINY, *BRACKET]))
    assert "[study] part boundary: " in out.stdout
    assert "[boundary] d=32 L=2: above [0.001, 0.01] (one grid point" in out.stdout
    _two_probes(runs / "boundary", [1e-3, 1e-2])


def _factor_data(tiny_data, data: Path) -> None:
    """The layout collapse_factor_study.sh prepares (the default corpus and three BPEs), each the tiny
    corpus, so that the script's preparation finds everything in place."""
    src = Path(tiny_data.prefix)
    layout = [(data / "news_text_document", data / "tokenizer.model")]
    layout += [(data / f"bpe{v}" / f"news{v}_text_document", data / f"bpe{v}" / f"bpe{v}.model")
               for v in (512, 2048, 8192)]
    for prefix, model in layout:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for f in src.parent.glob(src.name + ".*"):  # .bin, .idx and the tokenizer sidecar
            os.symlink(f, str(prefix) + f.name[len(src.name):])
        os.symlink(tiny_data.tokenizer_model, model)


def test_collapse_factor_study_first_sweep(tiny_data, tmp_path) -> None:
    """The paper part (one sweep); STUDY_FLAGS come after the part's flags, so they shrink it; KEEP in
    tmp_path keeps study/results untouched. The script goes on past a failed sweep: its exit is in
    STATUS.md."""
    out = tmp_path / "study"
    _factor_data(tiny_data, out / "data")
    run(["bash", "examples/collapse_factor_study.sh"], OUT=str(out), PARTS="paper",
        KEEP=str(tmp_path / "keep"), JOBS="1",
        STUDY_FLAGS=" ".join(["--widths", "32", "--depths", "2", "--presets", "paper-180m", *TINY, *BRACKET]))
    status = (out / "STATUS.md").read_text()
    log = (out / "paper_512x48.log").read_text()
    assert "finished paper_512x48 (exit 0," in status, status + log[-3000:]
    fit = json.loads((REPO / "study/results/grid_w20/boundary.json").read_text())["fit"]  # the script's law
    star = math.exp(fit["log_a"]) * 32 ** fit["b_width"] * 2 ** fit["c_depth"]  # lr* = a d^b L^c, ~0.0322
    assert "[boundary] d=32 L=2: above [0.01608, 0.06433] (one grid point" in log
    assert (tmp_path / "keep" / "paper_512x48" / "results.csv").is_file()
    _two_probes(out / "paper_512x48", [float(f"{star / 2:.4g}"), float(f"{star * 2:.4g}")])
