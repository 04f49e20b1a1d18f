"""The start-up self-test (a few milliseconds): the DeepSpeed behaviour the adapter relies on, checked on
the installed version, so a DeepSpeed that changed says so in one line instead of training wrongly.

* the skip decision (``steps.non_finite``) catches what DeepSpeed's own norm combiner returns for a
  group norm of inf, NaN and its -1 sentinel;
* the attributes the step overrides replace or read exist on the engine's optimizer;
* fused AdamW with ``found_inf`` leaves a parameter, both moments and the step count unchanged;
* a fragment of one mapped parameter of the engine round-trips (written through ``set_full``, read back
  through ``owned_fragment``, then restored).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megapost.ds_adapter import TESTED, fragments
from megapost.ds_adapter.steps import non_finite

BF16_ATTRS = ("get_grads_for_norm", "fp32_groups_gradient_flat_partition", "fp32_groups_flat_partition",
              "_lazy_init_hp_params_optimizer_state", "update_lp_params", "clear_hp_grads", "norm_type",
              # megapost.ds_adapter.overlap
              "accumulate_hp_grads_and_remove_lp", "fp32_groups_gradients_flat", "fp32_groups_gradients",
              "immediate_grad_update", "set_gradient_accumulation_boundary")
ZERO_ATTRS = ("unscale_and_clip_grads", "check_grad_overflow", "independent_gradient_partition_epilogue",
              "compute_grad_norm")
ENGINE_ATTRS = ("_take_model_step", "clip_fp32_gradients", "skipped_steps", "allreduce_gradients",
                "is_gradient_accumulation_boundary", "enable_backward_allreduce", "inside_no_sync_ctxt",
                "sequence_parallel_size", "gradient_average", "postscale_gradients",
                "gradient_predivide_factor")


def _decision() -> str | None:
    from deepspeed.runtime.utils import combine_grad_norm_groups

    for bad in (math.inf, math.nan, -1.0):
        combined = combine_grad_norm_groups([torch.tensor(2.0), torch.tensor(bad)])
        if not bool(non_finite(combined)):
            return f"a group norm of {bad} combines to {float(combined)}, which the skip would not catch"
    return None


def _attributes(engine: Any) -> str | None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    need = [(engine, ENGINE_ATTRS)]
    if isinstance(engine.optimizer, BF16_Optimizer):
        need.append((engine.optimizer, BF16_ATTRS))
    elif isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        need.append((engine.optimizer, ZERO_ATTRS))
    missing = [f"{type(obj).__name__}.{a}" for obj, attrs in need for a in attrs if not hasattr(obj, a)]
    return f"missing {', '.join(missing)}" if missing else None


def _fused_skip() -> str | None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(4)
    opt.step()
    before = [p.detach().clone(), *(t.clone() for t in opt.state[p].values())]
    p.grad = torch.full((4,), math.inf)
    opt.found_inf = torch.ones(())
    opt.step()
    after = [p.detach(), *opt.state[p].values()]
    if not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
        return "fused AdamW with found_inf changed the parameter or its state"
    return None


def _fragment_round_trip(engine: Any) -> str | None:
    p = next((q for q in engine.module.parameters() if fragments.is_mapped(q) and q._hp_mapping is not None),
             None)
    if p is None:
        return None  # no ZeRO/bf16 fragments on this rank
    start, numel, values = fragments.owned_fragment(p, (fragments.MASTER,))
    saved = values[fragments.MASTER].clone()
    full = torch.zeros(p.numel(), dtype=saved.dtype, device=saved.device)
    full[start:start + numel] = saved + 1.0
    fragments.set_full(p, full.view(p.shape), {})
    _, _, back = fragments.owned_fragment(p, (fragments.MASTER,))
    ok = torch.equal(back[fragments.MASTER], saved + 1.0)
    full[start:start + numel] = saved
    fragments.set_full(p, full.view(p.shape), {})
    return None if ok else "a parameter's fp32 fragment did not read back what was written"


def run(engine: Any) -> str | None:
    """None when the installed DeepSpeed behaves as the tested one, else the one-line reason."""
    import deepspeed

    for check in (_decision, lambda: _attributes(engine), _fused_skip, lambda: _fragment_round_trip(engine)):
        problem = check()
        if problem:
            return (f"DeepSpeed {deepspeed.__version__}: megapost's adapter self-test failed ({problem}); "
                    f"megapost is tested with deepspeed{TESTED}: pip install 'deepspeed{TESTED}'")
    return None
