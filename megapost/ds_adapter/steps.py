"""Optimizer-step pieces of DeepSpeed that megapost owns so that a step never waits for the device, and
a step with a non-finite gradient is skipped on the device.

DeepSpeed's fp32 clip (``runtime.utils.clip_grad_norm_``) builds its clip constants with
``torch.tensor(..., device=...)`` (a blocking host-to-device copy on CUDA) every step, and its bf16
optimizer reads the device twice per step: ``is_invalid_grad_norm`` (``bool(tensor)``) and
``clip_tensors_by_global_norm`` (``if clip_coef < 1``). Here the same arithmetic stays on the device:
the clip coefficient is ``min(1, max_norm / (norm + 1e-6))`` as a tensor (multiplying by 1.0 where
DeepSpeed skips the multiply changes no bit), and a non-finite norm (``~isfinite``: DeepSpeed's
combined ZeRO norm marks an invalid group +inf, its per-group helpers -1, a NaN stays NaN) skips the
AdamW update through fused AdamW's ``found_inf`` (parameters, both moments and the step count unchanged,
as DeepSpeed's skipped step leaves them). Each override hands that 0-d flag to ``record`` (megapost's
``engine.skips.SkipCounter``: the lr schedule and the skip count read it on the device); the norm is
reported as ``inf``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import groups

EPS = 1e-6  # DeepSpeed's clip epsilon
Record = Callable[[torch.Tensor], None]  # receives each step's "skipped" flag (0-d bool, on the device)


def non_finite(norm: torch.Tensor) -> torch.Tensor:
    """The skip decision: the norm is NaN, +-inf, or DeepSpeed's -1 sentinel of an invalid group norm."""
    return ~torch.isfinite(norm) | (norm < 0)


def _sum_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sum_i ||g_i||_2^2 in fp32 on ``device``, as DeepSpeed computes it (per-tensor norms, squared)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.detach().float().norm(2) for g in grads]).pow(2.0).sum()


def _model_parallel_sum(value: torch.Tensor, mpu: Any) -> torch.Tensor:
    if mpu is not None:
        group = mpu.get_model_parallel_group()
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + eps))`` on the device (no host read)."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def clip_fp32_grads(parameters: Any, max_norm: float, mpu: Any) -> torch.Tensor:
    """DeepSpeed's ``clip_grad_norm_`` (L2, model-parallel duplicates counted once, the DP mean of the
    norm) without host constants or branches (``max_norm`` 0: no clip): returns the norm, a 0-d device
    tensor."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    counted = [p.grad for p in params
               if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
    total = _model_parallel_sum(_sum_squares(counted, params[0].grad.device), mpu).pow(0.5)
    dp_group = groups._get_data_parallel_group()
    dp = dist.get_world_size(group=dp_group)
    if dp > 1:
        total = total * 1.0 / float(dp)
        dist.all_reduce(total, group=dp_group)
    if max_norm > 0.0:
        torch._foreach_mul_([p.grad.data for p in params], clip_coefficient(total, max_norm))
    return total


def fused_with_found_inf(optimizer: Any) -> bool:
    fused = bool(optimizer.defaults.get("fused"))
    return isinstance(optimizer, torch.optim.AdamW | torch.optim.Adam) and fused


def install_bf16_step(bf16_optimizer: Any, record: Record) -> bool:
    """Replace ``BF16_Optimizer.step`` on this instance with the sync-free step (same norm, same clip,
    same update); returns False, leaving DeepSpeed's step, where that is not possible (MoE, Muon, an
    optimizer without ``found_inf``, a norm other than L2)."""
    opt = bf16_optimizer
    if (opt.has_moe_layers or getattr(opt, "_uses_muon", False) or float(opt.norm_type) != 2.0
            or not fused_with_found_inf(opt.optimizer)):
        return False

    @torch.no_grad()
    def step(closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError("BF16_Optimizer.step does not support closure")
        opt.overflow = False  # a non-finite norm skips the update on the device instead
        grads, _ = opt.get_grads_for_norm()
        device = opt.fp32_groups_gradient_flat_partition[0].device
        norm = _model_parallel_sum(_sum_squares(grads, device), opt.mpu).pow(0.5)
        bad = non_finite(norm)
        record(bad)
        opt._global_grad_norm = torch.where(bad, torch.inf, norm)
        if opt.clip_grad > 0.0:
            coef = clip_coefficient(norm, opt.clip_grad)
            torch._foreach_mul_(opt.fp32_groups_gradient_flat_partition, coef)
        for param, grad in zip(opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition,
                               strict=True):
            param.grad = grad.to(param.dtype) if grad.dtype != param.dtype else grad
        opt.optimizer.found_inf = bad.float()
        try:
            opt.optimizer.step()
        finally:
            del opt.optimizer.found_inf
        if opt.grad_acc_dtype is not torch.float32:
            for param in opt.fp32_groups_flat_partition:
                param.grad = None
        opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()
        opt.clear_hp_grads()

    opt.step = step
    return True


# ---- ZeRO-1/2 (DeepSpeedZeroOptimizer) --------------------------------------------------------------
_ZERO_STEP_ACTIVE = [False]  # inside a sync-free ZeRO step: invalid norms are handled on the device


def _mask_nan_or_inf(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without its ``torch.tensor(val, device=...)``."""
    input.masked_fill_(~torch.isfinite(input), val)


def _patch_zero_module() -> None:
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    if getattr(zero, "_megapost_sync_free", False):
        return
    original = zero.is_invalid_grad_norm

    def is_invalid_grad_norm(norm: Any) -> bool:
        # in a sync-free step the -1 sentinel skips the update through found_inf (see install_zero_step)
        if _ZERO_STEP_ACTIVE[0] and isinstance(norm, torch.Tensor):
            return False
        return original(norm)

    zero.is_invalid_grad_norm = is_invalid_grad_norm
    zero.mask_nan_or_inf_with_val_inplace = _mask_nan_or_inf
    zero._megapost_sync_free = True


def install_zero_step(zero_optimizer: Any, record: Record) -> bool:
    """Make DeepSpeed's ZeRO-1/2 step sync-free on this instance: no overflow vote (``has_overflow``
    reads the device; a non-finite gradient gives a non-finite norm, which is checked instead), the
    norm's invalid check and clip coefficient on the device, and a non-finite norm skipping the fused
    AdamW update through ``found_inf``. Returns False (DeepSpeed's step kept) with loss scaling, CPU
    offload, MoE, Muon, or an optimizer without ``found_inf``."""
    opt = zero_optimizer
    if (opt.cpu_offload or opt.has_moe_layers or getattr(opt, "custom_loss_scaler", False)
            or getattr(opt, "dynamic_loss_scale", False) or float(getattr(opt, "loss_scale", 1.0)) != 1.0
            or any(g.get("use_muon", False) for g in opt.optimizer.param_groups)
            or not opt.compute_grad_norm or not fused_with_found_inf(opt.optimizer)):
        return False
    _patch_zero_module()
    opt.check_grad_overflow = False
    step = opt.step

    def unscale_and_clip_grads(grad_groups_flat: list[Any], total_norm: torch.Tensor) -> None:
        if "found_inf" not in opt.optimizer.__dict__:  # once per step (called once per param group)
            bad = non_finite(total_norm)
            record(bad)
            opt.optimizer.found_inf = bad.float()
        if opt.clip_grad > 0.0:
            scale = 1.0 / ((total_norm + 1e-6) / opt.clip_grad).clamp(min=1.0)
            torch._foreach_mul_([g for grad in grad_groups_flat
                                 for g in (grad if isinstance(grad, list) else [grad])], scale)

    def sync_free_step(closure: Any = None) -> None:
        _ZERO_STEP_ACTIVE[0] = True
        try:
            step(closure)
        finally:
            _ZERO_STEP_ACTIVE[0] = False
            opt.optimizer.__dict__.pop("found_inf", None)
        norm = opt._global_grad_norm
        if isinstance(norm, torch.Tensor):
            opt._global_grad_norm = torch.where(non_finite(norm), torch.inf, norm)

    opt.unscale_and_clip_grads = unscale_and_clip_grads
    opt.step = sync_free_step
    _stream_ordered_epilogue(opt)
    return True


def _stream_ordered_epilogue(opt: Any) -> None:
    """With ``overlap_comm`` on CUDA, DeepSpeed ends every backward with ``get_accelerator()
    .synchronize()`` (``independent_gradient_partition_epilogue``) before reusing the reduced gradients;
    ordering the compute stream after the reduction stream gives the same guarantee to everything that
    follows on the device without stopping the host. (CPU ranks never take that branch.)"""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if not getattr(opt, "overlap_comm", False) or accel.resolves_data_dependency():
        return
    epilogue = opt.independent_gradient_partition_epilogue

    def stream_ordered_epilogue() -> Any:
        synchronize = accel.synchronize
        accel.synchronize = lambda *_a: accel.current_stream().wait_stream(opt.reduction_stream)
        try:
            return epilogue()
        finally:
            accel.synchronize = synchronize

    opt.independent_gradient_partition_epilogue = stream_ordered_epilogue


# ---- pipeline engine -----------------------------------------------------------------------------------
def install_pipeline_loss_buffer(engine: Any) -> None:
    """The pipeline engine's non-last stages receive the step's loss into ``torch.Tensor([0, 0])
    .to(device)`` (a blocking host-to-device copy each step); receive it into a device buffer instead."""
    if engine.is_last_stage():
        return
    aggregate = engine._aggregate_total_loss

    def aggregate_total_loss() -> Any:
        if engine.module.get_additional_losses() is not None:
            return aggregate()
        losses = torch.zeros(2, device=engine.device)
        dist.broadcast(tensor=losses, src=engine._loss_stage_global_rank(),
                       group=engine.grid.get_pipe_parallel_group())
        engine.dp_group_loss = losses[0].clone().detach()
        return losses[1].clone().detach()

    engine._aggregate_total_loss = aggregate_total_loss
