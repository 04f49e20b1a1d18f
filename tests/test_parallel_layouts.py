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

from dataclasses import replace
from typing import Any

import pytest
from dist_utils import RunSpec, max_param_diff, max_rel_diff, relative_update_diff, run_layout

PRE, POST = {"norm_position": "pre"}, {"norm_position": "post"}
SGD = dict(optimizer="sgd", lr=0.5)

_references: dict[str, dict[str, Any]] = {}


def reference(spec: RunSpec) -> dict[str, Any]:
    """The single-process run of ``spec``'s model, data and optimizer (cached per session)."""
    key = replace(spec, tp=1, pp=1, sp=False, checkpoint_activations=False, probes=False)
    if repr(key) not in _references:
        _references[repr(key)] = run_layout(key)[0]
    return _references[repr(key)]


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
    ref = reference(spec)
    ranks = run_layout(spec, dp)
    out = ranks[0]
    sgd = spec.optimizer == "sgd"
    diffs = {
        "loss": max_rel_diff(out["losses"], ref["losses"]),
        "grad_norm": max_rel_diff(out["grad_norms"], ref["grad_norms"]) if ref["grad_norms"][0] else 0.0,
        "param_abs": max_param_diff(out["params"], ref["params"]),
        "param_rel_update": relative_update_diff(out["params"], ref["params"], ref["params0"]),
    }
    print(f"\n{spec.tp}x{spec.pp}x{dp} sp={spec.sp} {spec.optimizer} zero{spec.zero_stage}: "
          + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    assert max_param_diff(out["params0"], ref["params0"]) == 0.0, "initial weights depend on the layout"
    assert all(r["losses"] == out["losses"] for r in ranks), "ranks disagree on the loss"
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5, diffs
    assert diffs["param_rel_update"] <= (1e-5 if sgd else 1e-4), diffs
    assert diffs["param_abs"] <= (1e-6 if sgd else 1e-4), diffs
    if spec.probes:  # every probe reported once per micro-batch, checkpointed or not, and its dL/dY hook ran
        micro_batches = spec.steps * out["gas"]
        for r in ranks:
            assert set(r["probe_forward"].values()) == {micro_batches}, r["probe_forward"]
            assert set(r["probe_backward"].values()) == {micro_batches}, r["probe_backward"]
