"""Causal multi-head (or grouped-query) attention with RoPE, fused SDPA, optional per-head RMSNorm of
the queries and keys (--qk-norm) or of Q, K and V (HybridNorm), and the prefix-averaging intervention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapost.kernels import packed_linear, rope, rope_path, triton_rope, triton_rope_qkv
from megapost.model.config import ModelConfig
from megapost.model.fusion import Fusion, packable_weights
from megapost.model.norm import RMSNorm
from megapost.model.rope import apply_rope_tables, rope_cache, rope_tables


def causal_running_mean(v: torch.Tensor) -> torch.Tensor:
    """C_n V along the sequence (dim -2): row i is the mean of v_1..v_i."""
    counts = torch.arange(1, v.shape[-2] + 1, device=v.device, dtype=torch.float32).unsqueeze(-1)
    return (v.float().cumsum(dim=-2) / counts).to(v.dtype)


def repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, g, s, d_h] -> [b, g * n_rep, s, d_h]: K/V head j serves query heads j*n_rep .. j*n_rep+n_rep-1
    (the Llama / HF ``repeat_kv`` convention)."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Causal SDPA with ``n_rep`` query heads per K/V head. In fp32 K/V are repeated first: CUDA's only
    fp32 fused kernel (memory-efficient) does not take ``enable_gqa`` and SDPA would fall back to the
    O(s^2) math kernel; bf16/fp16 keep ``enable_gqa`` (flash takes it, no K/V copy)."""
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """softmax(QK^T/sqrt(d_h)) V W_O per head; heads are inferred from the projection widths, so a
    tensor-parallel wrapper can shard W_Q/W_K/W_V by columns and W_O by rows without changes here.
    With grouped-query attention W_K and W_V are ``num_query_groups * d_h`` wide and query head h reads
    K/V head h // (heads / groups). Head norms (``q_norm``, ``k_norm``, ``v_norm``) normalise each head
    over its d_h channels with one gain shared by all heads, before RoPE."""

    def __init__(self, cfg: ModelConfig, qkv_norm: bool = False) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.prefix_alpha = cfg.prefix_alpha
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, cfg.kv_size, bias=False)
        self.wv = nn.Linear(d, cfg.kv_size, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        qk = cfg.qk_norm or qkv_norm
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk else None
        self.v_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qkv_norm else None
        self.fusion = Fusion()  # megapost.model.fusion.set_kernel_fusion
        self._rope: tuple[torch.Tensor, ...] | None = None
        self._rope_by_dtype: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    def _rope_tables(self, seq: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin (``rope_tables``) in the activations' dtype, cached per dtype."""
        if torch.compiler.is_compiling():  # in a compiled graph: computed there, no cached state to guard
            return rope_tables(*rope_cache(seq, self.head_dim, self.rope_theta, device), dtype)
        if self._rope is None or self._rope[0].shape[0] < seq or self._rope[0].device != device:
            self._rope = rope_cache(seq, self.head_dim, self.rope_theta, device)
            self._rope_by_dtype = {}
        if dtype not in self._rope_by_dtype:
            self._rope_by_dtype[dtype] = rope_tables(*self._rope, dtype)
        cos, signed_sin = self._rope_by_dtype[dtype]
        return cos[:seq], signed_sin[:seq]

    def _packed(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
        """(the [b, s, heads + 2 groups, d_h] output of one Q/K/V GEMM, heads, groups) where ``qkv``
        fusion packs them, else None."""
        eager = not torch.compiler.is_compiling()
        weights = packable_weights(self.wq, self.wk, self.wv) if eager and self.fusion.on("qkv", x.dtype) \
            else None
        if weights is None:
            return None
        qkv = packed_linear(x, weights).view(*x.shape[:2], -1, self.head_dim)
        return qkv, weights[0].shape[0] // self.head_dim, weights[1].shape[0] // self.head_dim

    def _project(self, x: torch.Tensor,
                 packed: tuple[torch.Tensor, int, int] | None) -> tuple[torch.Tensor | None, ...]:
        """q, k, v as [b, heads, s, d_h] views, and the packed [b, s, heads + groups, d_h] view of q and
        k when one GEMM made them (``packed``; else None)."""
        b, s, _ = x.shape
        if packed is None:
            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, s, -1, self.head_dim).transpose(1, 2)

            return heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), None
        qkv, nq, nk = packed
        qk, v = qkv.split((nq + nk, nk), dim=2)  # one split: its backward is one cat of both gradients
        q, k = qk.split((nq, nk), dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qk

    def _triton_rope(self, x: torch.Tensor) -> bool:
        """Whether RoPE runs as the Triton kernel (``rope_path``; under auto not in fp32)."""
        return (not torch.compiler.is_compiling() and rope_path(x.device) == "triton"
                and self.fusion.triton_on("rope", x.dtype))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, qk: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """RoPE of q and k: one fused call on the packed ``qk`` when there is one, else one each."""
        cos, signed_sin = self._rope_tables(q.shape[2], q.device, q.dtype)
        if torch.compiler.is_compiling() or not self.fusion.on("rope", q.dtype):
            return apply_rope_tables(q, cos, signed_sin), apply_rope_tables(k, cos, signed_sin)
        fused = triton_rope if self._triton_rope(q) else rope
        if qk is None:
            return fused(q, cos, signed_sin), fused(k, cos, signed_sin)
        qk = fused(qk, cos.unsqueeze(1), signed_sin.unsqueeze(1))  # [b, s, heads + groups, d_h]
        q, k = qk.split((q.shape[1], k.shape[1]), dim=2)  # split, not slices: one cat in backward
        return q.transpose(1, 2), k.transpose(1, 2)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as [b, heads, s, d_h], after the head norms and RoPE. The packed GEMM's output without
        head norms, with the Triton RoPE: one op each way from it (``triton_rope_qkv``: the backward
        writes the packed gradient, no ``cat``)."""
        packed = self._packed(x)
        if packed is not None and self.q_norm is None and self.v_norm is None and self._triton_rope(x):
            cos, signed_sin = self._rope_tables(x.shape[1], x.device, x.dtype)
            qkv = triton_rope_qkv(*packed, cos.unsqueeze(1), signed_sin.unsqueeze(1))
            return tuple(t.transpose(1, 2) for t in qkv)
        q, k, v, qk = self._project(x, packed)
        if self.q_norm is not None:
            q, k, qk = self.q_norm(q), self.k_norm(k), None
        if self.v_norm is not None:
            v = self.v_norm(v)
        q, k = self._rotate(q, k, qk)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._qkv(x)
        n_rep = q.shape[1] // k.shape[1]
        out = grouped_sdpa(q, k, v, n_rep)
        if self.prefix_alpha:
            out = out - self.prefix_alpha * repeat_kv(causal_running_mean(v), n_rep)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)
