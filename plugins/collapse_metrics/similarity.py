"""Token similarity from additive partial sums (QUANTITIES.md, "Token similarity").

For one sequence X (n rows x_i in R^d):

    t_sim(X) = ||Pi X||_F^2 / ||X||_F^2 = ||sum_i x_i||^2 / (n sum_i ||x_i||^2)

The three sums (row sum s in R^d, sum of squares q, row count n) are additive over any split of the
rows, so sequence shards combine by one all-reduce of the packed partials [s, q, n] before the
nonlinear ratio. Sums are accumulated in fp32 (fp64 for fp64 inputs) whatever the activation dtype.
"""

from __future__ import annotations

import torch

EPS = 1e-30  # guards 0/0 for an all-zero sequence (t_sim is then reported as 0)


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 ones (never narrower than the input)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """2-norm (over everything, or over ``dim``) accumulated in ``accumulation_dtype``."""
    return torch.linalg.vector_norm(x, dim=dim, dtype=accumulation_dtype(x))


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """||x_i||_2 per token, shape x.shape[:-1]."""
    return norm(x, dim=-1)


def sequence_partials(x: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """[b, d + 2] per sequence of x [b, s, d]: row sum (d), sum of squared row norms, row count."""
    if norms is None:
        norms = token_norms(x)
    b, s, _ = x.shape
    row_sum = x.sum(dim=1, dtype=norms.dtype)
    sq = norms.square().sum(dim=1, keepdim=True)
    count = torch.full((b, 1), float(s), dtype=norms.dtype, device=x.device)
    return torch.cat([row_sum, sq, count], dim=1)


def tsim_from_partials(partials: torch.Tensor) -> torch.Tensor:
    """t_sim per sequence from (possibly shard-summed) partials [..., d + 2]: ||s||^2 / (n q)."""
    row_sum, sq, count = partials[..., :-2], partials[..., -2], partials[..., -1]
    return row_sum.square().sum(-1) / (count * sq).clamp_min(EPS)


def tsim(x: torch.Tensor) -> torch.Tensor:
    """t_sim of each sequence of x [b, s, d] -> [b] (or of one sequence [s, d] -> scalar), fp32."""
    if x.dim() == 2:
        return tsim(x[None])[0]
    return tsim_from_partials(sequence_partials(x))
