"""Every (TP, PP, DP) layout trains like one process: same seed, data and global batch through the
DeepSpeed engine (ZeRO-1 unless stated, fp32, clip 1.0) for 10 steps; per-step losses and global
gradient norms, the initial weights (exactly) and the weights after training must match the
single-process run.

Tolerances (fp32): losses and gradient norms 1e-5 relative (measured ~1e-7). Weights after SGD:
||Δw|| <= 1e-5 of the distance trained and 1e-6 absolute (gradients agree elementwise). After AdamW
1e-4 of both: the first Adam step is lr * g / (|g| + eps), so the few elements whose gradient is
near eps turn last-bit gradient differences (summation order of sharded matmuls) into parameter
differences of up to ~1% of lr.
"""

from __future__ import annotations

from typing import Any

import pytest
from dist_utils import RunSpec, check_layout_matches_single_process

PRE, POST = {"norm_position": "pre"}, {"norm_position": "post"}
SGD = dict(optimizer="sgd", lr=0.5)

def _layout(tp: int, pp: int, dp: int, slow: bool = False, **kw: Any) -> Any:
    spec = RunSpec(tp=tp, pp=pp, **{"model": PRE, **kw})
    name = f"tp{tp}-pp{pp}-dp{dp}" + "".join(f"-{k}" for k in ("sp", "checkpoint_activations") if kw.get(k))
    name += f"-{kw['optimizer']}" if "optimizer" in kw else ""
    name += f"-zero{kw['zero_stage']}" if "zero_stage" in kw else ""
    name += "-post" if kw.get("model") == POST else ""
    return pytest.param(spec, dp, id=name.replace("checkpoint_activations", "ckpt"),
                        marks=[pytest.mark.slow] if slow else [])


LAYOUTS = [
    _layout(1, 1, 1, checkpoint_activations=True, probes=True, model=POST),
    _layout(2, 1, 1, sp=True, checkpoint_activations=True, probes=True),
    _layout(1, 2, 1, checkpoint_activations=True, probes=True, model=POST),
    _layout(2, 2, 1, sp=True, probes=True, **SGD),
    _layout(1, 1, 2, slow=True),
    _layout(2, 1, 1, slow=True, model=POST),
    _layout(2, 1, 1, slow=True, sp=True, **SGD),
    _layout(2, 2, 1, slow=True),
    _layout(2, 2, 1, slow=True, sp=True),
    _layout(2, 1, 2, slow=True),
    _layout(2, 1, 2, slow=True, sp=True, model=POST),
    _layout(2, 1, 2, slow=True, zero_stage=0, **SGD),
    _layout(2, 1, 2, slow=True, sp=True, zero_stage=2, **SGD),
    _layout(1, 2, 2, slow=True),
    _layout(1, 2, 2, slow=True, checkpoint_activations=True, **SGD),
    _layout(2, 2, 2, slow=True),
    _layout(2, 2, 2, slow=True, sp=True, checkpoint_activations=True, probes=True),
]


@pytest.mark.parametrize("spec, dp", LAYOUTS)
def test_layout_matches_single_process(spec: RunSpec, dp: int) -> None:
    check_layout_matches_single_process(spec, dp)
