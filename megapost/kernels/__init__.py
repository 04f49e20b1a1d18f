"""Fused training kernels for the model: fewer, bigger ops per layer (one GEMM for several
projections, RoPE, SwiGLU and the residual add + RMSNorm as autograd Functions with hand-written
backwards) and the LM head + cross-entropy chunked over tokens (no full logits). Plain torch ops, no
torch.compile; on CUDA the residual add + RMSNorm, RoPE and the SwiGLU gate are Triton kernels when
Triton imports (``triton_norm``, ``triton_rope``, ``triton_swiglu``). Each is checked against the unfused
path in tests/test_kernels*.py. Which ones run is chosen per module by ``megapost.model.fusion``
(``--kernel-fusion``).

Imports nothing of megapost but utils (pyproject.toml's contracts)."""

from megapost.kernels.add_norm import add_rms_norm, rms_norm
from megapost.kernels.linear import packed_linear, packed_weight
from megapost.kernels.linear_ce import linear_cross_entropy
from megapost.kernels.rope import rope
from megapost.kernels.swiglu import swiglu_packed
from megapost.kernels.triton_common import triton_note
from megapost.kernels.triton_norm import norm_path, triton_add_rms_norm
from megapost.kernels.triton_rope import rope_path, triton_rope, triton_rope_qkv
from megapost.kernels.triton_swiglu import swiglu_path, triton_swiglu

__all__ = ["add_rms_norm", "linear_cross_entropy", "norm_path", "packed_linear", "packed_weight", "rms_norm",
           "rope", "rope_path", "swiglu_packed", "swiglu_path", "triton_add_rms_norm", "triton_note",
           "triton_rope", "triton_rope_qkv", "triton_swiglu"]
