"""The finite guard before a save names what it found non-finite, and scans the training state only
(a plugin's record may hold a metric undefined for the run as NaN: issue 52 item 1)."""

from __future__ import annotations

import math

import pytest
import torch

from megapost.checkpoint.finite_guard import refuse_non_finite
from megapost.checkpoint.writer import RankFiles

CPU = torch.device("cpu")


def test_the_error_names_the_non_finite_key():
    bad = torch.zeros(10)
    bad[7] = math.inf
    written = [("fp32/layers.0.weight", torch.ones(5)), ("exp_avg/layers.0.weight", bad),
               ("rng/cpu", torch.arange(4, dtype=torch.uint8))]
    with pytest.raises(FloatingPointError) as err:
        refuse_non_finite(written, [("loss of step 3", torch.tensor(2.0))], 3, None, CPU)
    msg = str(err.value)
    assert "exp_avg/layers.0.weight" in msg and "fp32/layers.0.weight" not in msg and "step 3" not in msg
    with pytest.raises(FloatingPointError, match=r"\(NaN or Inf in grad norm of step 4\) at iteration 4"):
        refuse_non_finite(written[:1], [("grad norm of step 4", math.nan)], 4, None, CPU)


def test_the_training_state_leaves_out_the_plugins_records():
    files = RankFiles([("shard", [("fp32/w", torch.ones(2))], {}),
                       ("state", [("plugins.collapse_metrics.x", torch.tensor([math.nan])),
                                  ("rng.cpu", torch.zeros(2))], {})])
    assert [key for key, _ in files.training_state()] == ["fp32/w", "rng.cpu"]
    refuse_non_finite(files.training_state(), [], 2, None, CPU)  # the NaN record does not stop a save
