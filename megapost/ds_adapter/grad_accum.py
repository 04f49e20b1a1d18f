"""Gradient-accumulation fusion for DeepSpeed's BF16_Optimizer: accumulate each bf16 gradient into its
fp32 buffer with one mixed-dtype ``add_`` (the cast happens inside the add's kernel) instead of
DeepSpeed's ``hp_grad.add_(lp.grad.to(fp32))``, a cast kernel and a temporary per parameter per
micro-batch (0.19.8, ``BF16_Optimizer._update_hp_grad``). Bit-identical: bf16 -> fp32 is exact and
the add is the same fp32 add. Only the plain case is replaced (no autoep folding correction, whose
path DeepSpeed keeps); the rest of the hook (``_hp_grad``, ``fp32_groups_has_gradients``,
``clear_lp_grads``) is done as DeepSpeed does it."""

from __future__ import annotations

from typing import Any

import torch


def install(optimizer: Any) -> bool:
    """Replace ``optimizer._update_hp_grad`` (a BF16_Optimizer) on this instance; False (nothing
    changed) when the optimizer lacks the attributes it reads or folds autoep gradients."""
    needed = ("_update_hp_grad", "fp32_groups_gradients", "fp32_groups_has_gradients")
    if not all(hasattr(optimizer, a) for a in needed) or getattr(optimizer, "autoep_folding_tp_group", None):
        return False
    original = optimizer._update_hp_grad

    @torch.no_grad()
    def update_hp_grad(lp: Any, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
        if lp.grad is None:
            return
        hp_grad = optimizer.fp32_groups_gradients[group_idx][param_idx]
        if hp_grad is None or getattr(optimizer, "autoep_folding_tp_group", None) is not None:
            original(lp, group_idx, param_idx, clear_lp_grads)
            return
        hp_grad.add_(lp.grad.view(hp_grad.shape))  # bf16 source, fp32 destination: one kernel
        lp._hp_grad = hp_grad
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer._update_hp_grad = update_hp_grad
    optimizer.megapost_fused_grad_accumulation = True
    return True
