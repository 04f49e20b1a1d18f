"""Rotary position embedding as one Triton kernel each way (``megapost::rope``, one torch op to dispatch
per direction), where ``megapost.kernels.rope`` dispatches 3 ops forward and 4 backward: the same
products and roundings in fp32 registers (forward x cos rounded, then one multiply-add; backward both
products rounded, then their sum), the rotate-half swap by index. Not bit-identical on a GPU (it may
contract a multiply and an add), so under ``--kernel-fusion`` auto not in fp32. Runs where
``triton_common.runs_on`` (CUDA with Triton); kernel body: ``triton_kernels.rope_rows``."""

from __future__ import annotations

from typing import Any

import torch

from megapost.kernels.triton_common import cdiv, jitted, runs_on


def rope_path(device: torch.device) -> str:
    """Which fused RoPE runs on ``device`` (the one place it is chosen): "triton" where the Triton
    kernels run (``runs_on``), else "function" (``megapost.kernels.rope``, torch ops)."""
    return "triton" if runs_on(device) else "function"


@torch.library.custom_op("megapost::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, S, H, D] (any strides, the last 1) rotated by the tables [S, D] (transposed rotation when
    ``backward``); contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    bsz, seq, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = bsz * seq * heads
    block_d = 1 << max(0, (dim // 2 - 1).bit_length())
    block_r = max(1, min(32, 2048 // block_d))
    jitted("rope_rows")[(cdiv(rows, block_r),)](
        x, cos, signed_sin, y, rows, seq, heads, x.stride(0), x.stride(1), x.stride(2), dim // 2,
        BACKWARD=backward, BLOCK_R=block_r, BLOCK_D=block_d)
    return y


@_rope_op.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, backward: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _TritonRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.ops.megapost.rope(x, cos, signed_sin, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.ops.megapost.rope(grad, cos, signed_sin, True), None, None


def triton_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``megapost.kernels.rope``'s contract in Triton: ``x`` [b, s, heads, d] with tables [s, 1, d], or
    [b, heads, s, d] with tables [s, d] (rotated as its [b, s, heads, d] transpose); the tables take
    no gradient."""
    heads_first = cos.dim() == 2
    rows = x.transpose(1, 2) if heads_first else x
    dim = x.shape[-1]
    tables = [t.reshape(-1, dim).contiguous() for t in (cos, signed_sin)]
    y = _TritonRope.apply(rows, *tables)
    return y.transpose(1, 2) if heads_first else y
