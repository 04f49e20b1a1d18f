"""Layout invariance through the real trainer (``megapost.pretrain --plugins collapse_metrics``): the
JSONL written at (TP, PP, DP) = (2,1,1)+SP, (1,2,1), (1,1,2), (2,2,1)+SP, and with activation
checkpointing, equals the one-process run; resume continues the file; a measured step at init."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from collapse_helpers import assert_close
from launch_utils import pretrain, read_scalars, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

REL = 1e-4  # a few Adam steps in fp32 under different reduction orders
ITERS = 3
LAYOUTS = {  # name: (processes, extra flags)
    "tp2-sp": (2, {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    "pp2": (2, {"--pipeline-model-parallel-size": 2}),
    "dp2": (2, {}),
    "tp2-pp2-sp": (4, {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                       "--sequence-parallel": True}),
    "checkpoint-activations": (1, {"--checkpoint-activations": True}),
}
_runs: dict[str, Path] = {}


def train(data, tmp: Path, name: str, nprocs: int = 1, **flags) -> Path:
    if name not in _runs:
        tb = tmp / name
        base = {"--train-iters": ITERS, "--num-layers": 4, "--zero-stage": 1, "--tensorboard-dir": tb,
                "--plugins": "collapse_metrics", "--collapse-at-init": True, "--lr-warmup-iters": 0}
        pretrain(tiny_model_flags(data, **{**base, **flags}), nprocs=nprocs)
        _runs[name] = tb
    return _runs[name]


def records(tb: Path) -> dict[tuple, dict]:
    lines = [json.loads(line) for line in (tb / "collapse_metrics.jsonl").read_text().splitlines()]
    return {(r["step"], r.get("layer"), r.get("sublayer")): r for r in lines}


@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=[] if name == "tp2-sp" else [pytest.mark.slow]) for name in LAYOUTS])
def test_layout_matches_single_process(tiny_data, tmp_path_factory, layout):
    tmp = tmp_path_factory.mktemp("collapse-layouts")
    ref = records(train(tiny_data, tmp, "single"))
    nprocs, flags = LAYOUTS[layout]
    got = records(train(tiny_data, tmp, layout, nprocs, **flags))
    assert got.keys() == ref.keys() and len(ref) == (ITERS + 1) * (4 * 2 + 1)
    for key, want in ref.items():
        for field, value in want.items():
            if isinstance(value, float):
                assert_close(got[key][field], value, REL, f"{layout} {key} {field}")
            else:
                assert got[key][field] == value, (layout, key, field)


PLACEMENT_LAYOUTS = {  # placement flags checked at TP=2 with sequence parallelism against one process
    "hybrid": {"--norm-position": "hybrid"},  # null RMS factor (FFN), q/k/v head-norm gains under TP
    "dyt-qk-norm": {"--norm-position": "dyt", "--qk-norm": True},  # no RMS factor at all; DyT scalars
    "sandwich": {"--norm-position": "sandwich"},  # output norms
    "deepnorm": {"--norm-position": "deepnorm"},  # scaled residual
}


@pytest.mark.parametrize("placement", [
    pytest.param(name, marks=[] if name == "hybrid" else [pytest.mark.slow]) for name in PLACEMENT_LAYOUTS])
def test_placement_metrics_match_single_process_under_tp_sp(tiny_data, tmp_path_factory, placement):
    """Every metric of a non-Post/Pre placement at TP=2+SP equals the one-process run, nulls included."""
    tmp = tmp_path_factory.mktemp(f"collapse-{placement}")
    flags = PLACEMENT_LAYOUTS[placement]
    ref = records(train(tiny_data, tmp, f"{placement}-single", **flags))
    nprocs, layout = LAYOUTS["tp2-sp"]
    got = records(train(tiny_data, tmp, f"{placement}-tp2-sp", nprocs, **flags, **layout))
    assert got.keys() == ref.keys()
    for key, want in ref.items():
        for field, value in want.items():
            if isinstance(value, float):
                assert_close(got[key][field], value, REL, f"{placement} {key} {field}")
            else:
                assert got[key][field] == value, (placement, key, field)
    if placement == "hybrid":
        assert all(r["rms_factor_mean"] is None for k, r in ref.items() if k[2] == "ffn")
        assert all(r["rms_factor_mean"] > 0 for k, r in ref.items() if k[2] == "attn")


def test_single_process_run_outputs(tiny_data, tmp_path_factory):
    tb = train(tiny_data, tmp_path_factory.mktemp("collapse-layouts"), "single")
    recs = records(tb)
    assert all(recs[(0, layer, "attn")]["alpha"] is None for layer in range(1, 5))  # forward-only init
    assert all(recs[(s, layer, k)]["alpha"] > 0 for s in range(1, ITERS + 1) for layer in range(1, 5)
               for k in ("attn", "ffn"))
    loss = read_scalars(tb, "collapse/loss")
    assert sorted(loss) == list(range(ITERS + 1))
    assert loss[2] == pytest.approx(read_scalars(tb, "train/lm_loss")[2], rel=1e-6)
