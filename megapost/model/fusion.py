"""Which fused kernels (``megapost.kernels``) the model's modules use: ``--kernel-fusion``.

"auto" (the default) runs every fusion that is bit-identical to the unfused path in fp32 (RoPE, the
SwiGLU gate, the fp32 gradient accumulation, the residual add + RMSNorm) everywhere, and the packed
Q/K/V and W_1/W_3 GEMMs (which change fp32 rounding: one GEMM sums dx over all the projections' rows at
once) and the chunked head + cross-entropy (``ce``: sums dW over token chunks) only when the
activations are not fp32, so fp32 runs keep their bits. ``norm`` replaces torch's composite RMSNorm
(CPU) bit for bit; on CUDA it is a Triton kernel (not bit-identical: under "auto" not in fp32), or
nothing without Triton (``megapost.kernels.norm_path``); ``rope`` on CUDA likewise a Triton kernel
(``megapost.kernels.rope_path``). "none" is
the unfused reference; a comma list of ``FUSIONS`` forces exactly those on. Under torch.compile the
modules take the unfused expressions (Inductor fuses them itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FUSIONS = ("rope", "qkv", "w13", "swiglu", "grad-accum", "norm", "ce")
EXACT_IN_FP32 = frozenset({"rope", "swiglu", "grad-accum", "norm"})
TRITON_FUSIONS = ("norm", "rope", "swiglu")  # those with a Triton kernel (megapost.kernels.triton_*)


@dataclass(frozen=True)
class Fusion:
    """``names`` None: "auto" (module docstring); else exactly these fusions. ``triton`` False
    (``--no-triton-kernels``): no Triton kernel, the fusions' torch paths; ``triton_off``: those
    fusions' torch paths (their kernels failed the start-up check)."""

    names: frozenset[str] | None = None
    triton: bool = True
    triton_off: frozenset[str] = frozenset()  # fusions whose Triton kernel failed its start-up check


    def on(self, name: str, dtype: torch.dtype | None = None, exact: bool | None = None) -> bool:
        """Whether fusion ``name`` runs for activations of ``dtype``; ``exact`` False: this
        implementation of it is not bit-identical (under "auto" then not in fp32)."""
        if self.names is not None:
            return name in self.names
        exact = name in EXACT_IN_FP32 if exact is None else exact
        return exact or (dtype is not None and dtype != torch.float32)

    def triton_on(self, name: str, dtype: torch.dtype | None = None) -> bool:
        """Whether fusion ``name`` runs as its Triton kernel where one runs (not bit-identical: under
        "auto" not in fp32; not one of ``triton_off``, megapost.kernels.triton_check's failures)."""
        return self.triton and name not in self.triton_off and self.on(name, dtype, exact=False)

    def __str__(self) -> str:
        return "auto" if self.names is None else ",".join(sorted(self.names)) or "none"


def parse_fusion(spec: str, triton: bool = True) -> Fusion:
    """``--kernel-fusion`` "auto", "none" or a comma list of ``FUSIONS`` (``triton``: False for
    ``--no-triton-kernels``); ValueError names the flag."""
    if spec == "auto":
        return Fusion(triton=triton)
    names = frozenset() if spec == "none" else frozenset(n.strip() for n in spec.split(",") if n.strip())
    unknown = sorted(names - set(FUSIONS))
    if unknown:
        raise ValueError(f"--kernel-fusion: unknown {', '.join(unknown)}; use auto, none or a comma list "
                         f"of {', '.join(FUSIONS)}")
    if "swiglu" in names and "w13" not in names:
        raise ValueError("--kernel-fusion: swiglu works on the packed W_1/W_3 output; add w13")
    return Fusion(names, triton)


def set_kernel_fusion(module: nn.Module, fusion: Fusion) -> int:
    """Give every module under ``module`` that has a ``fusion`` attribute this one; returns the count."""
    count = 0
    for sub in module.modules():
        if hasattr(sub, "fusion"):
            sub.fusion = fusion
            count += 1
    return count


def packable_weight(linear: nn.Module) -> torch.Tensor | None:
    """The weight to multiply ``linear``'s input with when it is fused with sibling projections: a
    bias-free ``nn.Linear``'s own, or what a module offering ``packable_weight()`` (a tensor-parallel
    shard whose input its parent maps) returns; None when it cannot be fused."""
    if type(linear) is nn.Linear:
        return linear.weight if linear.bias is None else None
    offer = getattr(linear, "packable_weight", None)
    return offer() if callable(offer) else None


def packable_weights(*linears: nn.Module) -> list[torch.Tensor] | None:
    """``packable_weight`` of each, or None if any cannot be fused."""
    weights = [packable_weight(m) for m in linears]
    return None if any(w is None for w in weights) else weights
