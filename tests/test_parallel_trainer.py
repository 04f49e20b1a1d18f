"""The real trainer (``megapost.pretrain`` under DeepSpeed's launcher) on tensor/pipeline/sequence
parallel layouts logs the same losses and gradient norms as one process (TensorBoard scalars, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_utils import pretrain, read_scalars, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

_single: dict[str, tuple[dict[int, float], dict[int, float]]] = {}


def _train(data, tmp: Path, nprocs: int, **flags) -> tuple[dict[int, float], dict[int, float]]:
    tb = tmp / f"tb-{nprocs}-{'-'.join(map(str, flags.values()))}"
    base = {"--train-iters": 5, "--zero-stage": 1, "--norm-position": "pre", "--tensorboard-dir": tb}
    pretrain(tiny_model_flags(data, **base, **flags), nprocs=nprocs)
    return read_scalars(tb, "train/lm_loss"), read_scalars(tb, "train/grad_norm")


@pytest.mark.parametrize("tp, pp, sp", [
    (2, 1, True),
    pytest.param(2, 2, True, marks=pytest.mark.slow),
    pytest.param(1, 2, False, marks=pytest.mark.slow),
])
def test_trainer_layout_matches_single_rank(tiny_data, tmp_path_factory, tp: int, pp: int, sp: bool) -> None:
    tmp = tmp_path_factory.mktemp("trainer")
    if "ref" not in _single:
        _single["ref"] = _train(tiny_data, tmp, 1)
    ref_loss, ref_norm = _single["ref"]
    loss, norm = _train(tiny_data, tmp, tp * pp, **{"--tensor-model-parallel-size": tp,
                                                    "--pipeline-model-parallel-size": pp,
                                                    "--sequence-parallel": sp})
    assert len(ref_loss) == 5 and loss.keys() == ref_loss.keys() and norm.keys() == ref_norm.keys()
    assert list(loss.values()) == pytest.approx(list(ref_loss.values()), rel=1e-5)
    assert list(norm.values()) == pytest.approx(list(ref_norm.values()), rel=1e-5)


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 2), pytest.param(1, 2, 1, marks=pytest.mark.slow)])
def test_bf16_layout_matches_single_rank(tiny_data, tmp_path_factory, tp: int, pp: int, dp: int) -> None:
    """bf16 (fp32 master weights, fp32 accumulation, fp32 gradient reduction; the one-rank data-parallel
    reduction skipped) trains like one bf16 process: losses and grad norms within bf16 rounding."""
    tmp = tmp_path_factory.mktemp("trainer-bf16")
    ref_loss, ref_norm = _train(tiny_data, tmp, 1, **{"--bf16": True})
    loss, norm = _train(tiny_data, tmp, tp * pp * dp, **{"--bf16": True, "--tensor-model-parallel-size": tp,
                                                        "--pipeline-model-parallel-size": pp})
    assert len(ref_loss) == 5 and loss.keys() == ref_loss.keys()
    assert list(loss.values()) == pytest.approx(list(ref_loss.values()), rel=2e-3)
    assert list(norm.values()) == pytest.approx(list(ref_norm.values()), rel=2e-2)
