"""RMSNorm with a learned gain (apex's fused kernel when importable, else torch's F.rms_norm; under
``--kernel-fusion`` norm on CPU, where F.rms_norm is a composite, ``megapost.kernels.add_rms_norm``, and
on CUDA the add + norm as one Triton kernel: ``megapost.kernels.norm_path``), its residual add fused in
(``RMSNorm(x, h)``), and Dynamic Tanh, the norm-free replacement of the ``dyt``
placement."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapost.kernels import add_rms_norm, norm_path, rms_norm, triton_add_rms_norm
from megapost.model.fusion import Fusion

try:  # optional fused kernel: usable only when its CUDA extension loads (a Python-only apex install
    # imports fine and fails at the first call)
    import fused_layer_norm_cuda  # type: ignore  # noqa: F401
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - apex is optional and often half-installed
    _ApexRMSNorm = None


class RMSNorm(nn.Module):
    """y = g * x / sqrt(mean(x^2) + eps), computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fusion = Fusion()  # megapost.model.fusion.set_kernel_fusion

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def _fused(self, x: torch.Tensor) -> str | None:
        """Which fused path runs, in eager mode: "function" (replacing torch's composite, bit-identical),
        "triton" (the add + norm in one kernel, not bit-identical) or None (``norm_path``)."""
        if torch.compiler.is_compiling():
            return None
        path = norm_path(x.device)
        if path == "triton":
            return path if self.fusion.triton_on("norm", x.dtype) else None
        return path if path == "function" and self.fusion.on("norm", x.dtype) else None

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``self(x)``: the norm of x. ``self(x, h, scale)``: (y, the norm of y) for y = ``scale`` * x + h,
        one fused Function where ``_fused`` (a module call either way: hooks on the norm run)."""
        if h is None:
            return self._norm(x)
        path = self._fused(x)
        if path is not None:
            fused = triton_add_rms_norm if path == "triton" else add_rms_norm
            return fused(x, h, self.weight, self.eps, scale)
        y = x + h if scale == 1.0 else x * scale + h
        return y, self._norm(y)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # alone not in fp32: where x has other readers autograd adds their gradients to the norm's
        # three terms one by one, the Function to their sum (in bf16 autograd also sums them first);
        # on CUDA torch's (apex's) kernel: a norm alone is one kernel each way there
        if self._fused(x) == "function" and x.dtype != torch.float32:
            return rms_norm(x, self.weight, self.eps)
        if _ApexRMSNorm is not None and x.is_cuda:
            from apex.normalization.fused_layer_norm import fused_rms_norm_affine  # type: ignore

            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        # torch computes in fp32 internally for bf16/fp16 inputs (bit-identical to upcasting first,
        # tested), without the casts' copies and their backward
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025) as in its LLaMA models: y = g * tanh(a * x) with a learned
    scalar a (init ``alpha_init``) and a per-channel gain g (init 1), no bias; computed in fp32."""

    def __init__(self, dim: int, alpha_init: float) -> None:
        super().__init__()
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.full((1,), self.alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.alpha.fill_(self.alpha_init)
        self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.alpha.float() * x.float()) * self.weight.float()).to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, alpha_init: float) -> nn.Module:
    """The residual-stream norm of a placement: RMSNorm ("rms") or DyT ("dyt", init ``alpha_init``)."""
    return DyT(dim, alpha_init) if kind == "dyt" else RMSNorm(dim, eps)
