"""``--compile`` (regional torch.compile of the blocks) through the real trainer: the same losses as
eager within fp32 rounding, with activation checkpointing, collapse_metrics probes and TP+SP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from collapse_helpers import assert_close
from launch_utils import pretrain, read_scalars, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

ITERS = 4
TINY = {"--num-layers": 2, "--hidden-size": 32, "--ffn-hidden-size": 64, "--seq-length": 16,
        "--train-iters": ITERS, "--zero-stage": 1, "--lr-warmup-iters": 0}


def _train(data, tb: Path, nprocs: int = 1, **flags) -> tuple[dict[int, float], str]:
    out = pretrain(tiny_model_flags(data, **{**TINY, "--tensorboard-dir": tb, **flags}), nprocs=nprocs)
    return read_scalars(tb, "train/lm_loss"), out.stdout


def _records(tb: Path) -> dict[tuple, dict]:
    lines = [json.loads(line) for line in (tb / "collapse_metrics.jsonl").read_text().splitlines()]
    return {(r["step"], r.get("layer"), r.get("sublayer")): r for r in lines}


def test_compile_matches_eager_with_checkpointing_and_probes(tiny_data, tmp_path) -> None:
    """Steps 1, 3 run compiled (checkpointed, recomputed compiled), steps 2, 4 are collapse-measured
    (eager, recomputed eagerly): losses and the measured metrics equal the eager run's."""
    flags = {"--checkpoint-activations": True, "--plugins": "collapse_metrics", "--collapse-interval": 2}
    ref, _ = _train(tiny_data, tmp_path / "eager", **flags)
    got, stdout = _train(tiny_data, tmp_path / "compiled", **flags, **{"--compile": True})
    assert "--compile: 2 transformer blocks compiled" in stdout
    assert sorted(ref) == list(range(1, ITERS + 1)) and got.keys() == ref.keys()
    assert list(got.values()) == pytest.approx(list(ref.values()), rel=1e-5)
    want, have = _records(tmp_path / "eager"), _records(tmp_path / "compiled")
    assert have.keys() == want.keys() and {k[0] for k in want} == {2, 4}
    for key, record in want.items():
        for field, value in record.items():
            if isinstance(value, float):
                assert_close(have[key][field], value, 1e-4, f"{key} {field}")
            else:
                assert have[key][field] == value, (key, field)


_eager: dict[str, dict[int, float]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    {"--tensor-model-parallel-size": 2, "--sequence-parallel": True},
    {"--pipeline-model-parallel-size": 2},
], ids=["tp2-sp", "pp2"])
def test_compile_parallel_layout_matches_single_process(tiny_data, tmp_path_factory, layout) -> None:
    """TP=2+SP (collectives as graph breaks) or PP=2 (DeepSpeed pipeline stages) compiled logs the
    single-process eager losses."""
    tmp = tmp_path_factory.mktemp("compile")
    if "ref" not in _eager:
        _eager["ref"], _ = _train(tiny_data, tmp / "eager")
    ref = _eager["ref"]
    got, stdout = _train(tiny_data, tmp / "compiled", nprocs=2, **{"--compile": True, **layout})
    assert "transformer blocks compiled" in stdout
    assert sorted(ref) == list(range(1, ITERS + 1)) and got.keys() == ref.keys()
    assert list(got.values()) == pytest.approx(list(ref.values()), rel=1e-5)
