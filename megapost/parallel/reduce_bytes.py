"""Bytes one data-parallel rank moves per optimizer step to reduce gradients and gather weights, by
ZeRO stage, as DeepSpeed 0.19's optimizers do it for megapost's config — the one formula behind the
trainer's start-up line, the ZeRO-1/2 choice (megapost.config.resolved.grad_reduction) and the
planner's data-parallel communication term (megapost.plan.search).

With P parameters on the rank, n data-parallel ranks, m micro-batches per step, g bytes per reduced
gradient element (fp32: 4; 2 with ``--grad-reduce-in-bf16`` under bf16) and w bytes per weight
element (bf16: 2, fp32: 4), counted on a ring (an all-reduce sends 2(n-1)/n of its buffer, an
all-gather (n-1)/n):

- ZeRO-0 (torch optimizer) and ZeRO-1 (``BF16_Optimizer`` for bf16, ``DeepSpeedZeroOptimizer`` for
  fp32): gradients accumulate locally; the engine reduces them once, at the last micro-batch
  (``allreduce_gradients`` at the accumulation boundary): 2(n-1)/n * g * P.
- ZeRO-2: every micro-batch's backward all-reduces its gradient buckets
  (``overlapping_partition_gradients_reduce_epilogue`` runs at every micro-batch; the buckets are
  all-reduced whole, ``use_multi_rank_bucket_allreduce``): m * 2(n-1)/n * g * P.
- ZeRO >= 1 then all-gathers the updated weights once: (n-1)/n * w * P.

So ZeRO-2 moves no more than ZeRO-1 only at m = 1 (where it overlaps and keeps less memory).

megapost's distributed optimizer (megapost.parallel.dist_optimizer, Megatron's): one reduce-scatter of
the fp32-accumulated gradient per step, (n-1)/n * g * P, and one all-gather of the updated weights,
(n-1)/n * w * P (``dist_optimizer_bytes``).
Counted against the real trainer on gloo by tests/test_reduce_bytes.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReduceBytes:
    """Per rank per optimizer step: wire bytes (ring) and buffer bytes entering collectives."""

    gradients: float  # wire bytes of the gradient reductions
    gather: float  # wire bytes of the weight all-gather
    payload: float  # buffer bytes handed to the collectives (gradients reduced + weights gathered)
    reductions: int  # how many times the full gradient is reduced per step

    @property
    def total(self) -> float:
        return self.gradients + self.gather


def grad_reductions(zero_stage: int, micro_batches: int) -> int:
    """Full-gradient reductions per optimizer step: every micro-batch under ZeRO-2, else once."""
    return micro_batches if zero_stage >= 2 else 1


def dp_step_bytes(params: int, dp: int, zero_stage: int, micro_batches: int, bf16: bool,
                  reduce_in_bf16: bool = False) -> ReduceBytes:
    """The bytes of the module docstring for ``params`` on this rank (none at ``dp`` 1)."""
    if dp <= 1:
        return ReduceBytes(0.0, 0.0, 0.0, 0)
    ring = (dp - 1) / dp
    g = 2 if (bf16 and reduce_in_bf16) else 4
    w = 2 if bf16 else 4
    k = grad_reductions(zero_stage, micro_batches)
    grads = k * g * params
    gather = w * params if zero_stage >= 1 else 0
    return ReduceBytes(2 * ring * grads, ring * gather, float(grads + gather), k)


def dist_optimizer_bytes(params: int, dp: int, bf16: bool, reduce_in_bf16: bool = False) -> ReduceBytes:
    """The distributed optimizer's bytes for ``params`` on this rank (module docstring)."""
    if dp <= 1:
        return ReduceBytes(0.0, 0.0, 0.0, 0)
    ring = (dp - 1) / dp
    g = 2 if (bf16 and reduce_in_bf16) else 4
    w = 2 if bf16 else 4
    return ReduceBytes(ring * g * params, ring * w * params, float((g + w) * params), 1)


def fewer_bytes_stage(dp: int, micro_batches: int, bf16: bool, reduce_in_bf16: bool) -> int:
    """ZeRO stage 1 or 2, whichever moves fewer bytes per step (the ratio does not depend on the
    parameter count; a tie goes to 2: it overlaps the reduction with backward and partitions the
    gradients)."""
    one, two = (dp_step_bytes(1, dp, z, micro_batches, bf16, reduce_in_bf16).total for z in (1, 2))
    return 2 if two <= one else 1


def describe(b: ReduceBytes, zero_stage: int, micro_batches: int) -> str:
    """The start-up line's words for ``b`` (a data-parallel group of more than one rank)."""
    how = "every micro-batch" if b.reductions > 1 else "once per step"
    mb = f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''}"
    return (f"gradients reduced {how} (ZeRO-{zero_stage}, {mb} per step): "
            f"{b.total / 2**20:,.1f} MiB per rank per step on a ring ({b.gradients / 2**20:,.1f} MiB "
            f"gradients + {b.gather / 2**20:,.1f} MiB weight all-gather)")
