"""--z-loss through the real trainer: the logged lm_loss stays the cross-entropy, the z term is logged
beside it, and it changes the training (through the gradient only)."""

from __future__ import annotations

import math

import pytest
from launch_utils import pretrain, read_scalars, tiny_model_flags

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs


def test_z_loss_is_logged_and_enters_the_gradient_only(tiny_data, tmp_path) -> None:
    runs = {}
    for name, coef in (("plain", None), ("z", 1e-2)):
        tb = tmp_path / name
        pretrain(tiny_model_flags(tiny_data, **{"--tensorboard-dir": tb, "--train-iters": 3,
                                                "--z-loss": coef, "--runs-dir": tmp_path / "runs"}))
        runs[name] = (read_scalars(tb, "train/lm_loss"), read_scalars(tb, "train/z_loss"))
    (plain, no_z), (loss, z) = runs["plain"], runs["z"]
    assert not no_z and sorted(z) == [1, 2, 3]
    # same init and data: step 1's loss is the same cross-entropy; the z term moves later steps
    assert loss[1] == pytest.approx(plain[1], rel=1e-6)
    assert loss[3] != pytest.approx(plain[3], rel=1e-6)
    # at init the logits are near zero, so log Z ~ log(vocab): z ~ coef * log(vocab)^2
    vocab = 512
    assert 0.5 < z[1] / (1e-2 * math.log(vocab) ** 2) < 2.0
