"""The bf16 gradient reduction overlapped with the last micro-batch's backward, as Megatron-core's DDP
does with ``overlap_grad_reduce``, on DeepSpeed's bf16 ZeRO-1 optimizer (``BF16_Optimizer``).

DeepSpeed (0.19.8) accumulates every micro-batch's bf16 gradient into the optimizer's flat fp32
buffer (``fp32_groups_gradients_flat``, one per parameter group) as autograd produces it
(``immediate_grad_update``: a post-accumulate-grad hook calls ``accumulate_hp_grads_and_remove_lp``),
and after the last micro-batch's backward the engine all-reduces those buffers in one blocking pass
(``allreduce_gradients`` -> ``buffered_allreduce_fallback``: one flattened copy, all-reduced, scaled by
1/DP, copied back). Here each buffer is cut into contiguous buckets of whole parameters (walked from
the last parameter, the first whose gradient backward produces; the alignment padding in the bucket
of the group's last parameter), and on the accumulation-boundary micro-batch only, the hook that
accumulates a bucket's last gradient launches that bucket's asynchronous all-reduce, in place, while
backward goes on. The engine's boundary reduction is replaced by: launch any bucket not yet launched
(a parameter that received no gradient), wait for every handle in launch order, then apply DeepSpeed's
scaling (and, with a non-fp32 ``communication_data_type``, its cast back). So the same buffers are
reduced with the same arithmetic (sum, then x 1/DP): the same bits at DP2 (a sum of two operands
does not depend on how the buffer is cut; tests/test_bf16_overlap.py), and the same bytes (every
element of every buffer once; tests/test_reduce_bytes.py). At DP > 2 a ring sums a bucket's elements
in an order that follows the cut, so a reduced gradient may differ in its last bit: fp32 rounding,
not bits, is promised there (DP4 on gloo: tests/test_bf16_overlap.py). No host read is added
(tests/test_host_syncs.py); ``wait()`` of an NCCL handle only orders the compute stream after the
reduction.

Every rank must produce the same parameters' gradients in the same order (as in Megatron's DDP):
the collectives are matched by launch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.utils import groups


@dataclass
class Bucket:
    """A contiguous range [start, end) of group ``group``'s flat fp32 gradient buffer."""

    group: int
    start: int
    end: int
    params: tuple[int, ...]  # indices into the optimizer's bf16_groups[group]
    view: torch.Tensor
    pending: int = 0  # gradients of this bucket not yet accumulated on this boundary micro-batch
    handle: Any = None  # the async all-reduce's work handle, while in flight
    sent: torch.Tensor | None = None  # the tensor being all-reduced (view, or its cast copy)
    ready: list[bool] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start


def cut_buckets(sizes: list[int], total: int, bucket_elements: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, end, parameter indices) of contiguous buckets over a flat buffer of ``total`` elements
    holding parameters of ``sizes`` elements in order: walked from the last parameter, a bucket closes
    once it holds ``bucket_elements`` or more (whole parameters, as Megatron's buckets); the last
    parameter's bucket also holds the padding after it."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    out: list[tuple[int, int, tuple[int, ...]]] = []
    end, members = total, []
    for j in range(len(sizes) - 1, -1, -1):
        members.append(j)
        if end - offsets[j] >= bucket_elements or j == 0:
            out.append((offsets[j], end, tuple(reversed(members))))
            end, members = offsets[j], []
    return out


class GradOverlap:
    """The overlapped reduction installed on one engine (``install``); ``buckets`` in launch-ready
    order of a backward (the tail of each group first)."""

    def __init__(self, engine: Any, bucket_elements: int) -> None:
        opt = engine.optimizer
        self.engine, self.opt = engine, opt
        self.group = groups._get_sequence_data_parallel_group()  # what the engine's reduction uses
        self.dp_world_size = dist.get_world_size(self.group) / float(engine.sequence_parallel_size)
        self.comm_dtype = engine.communication_data_type
        self.buckets: list[Bucket] = []
        self.owner: dict[tuple[int, int], Bucket] = {}
        for i, flat in enumerate(opt.fp32_groups_gradients_flat):
            sizes = [t.numel() for t in opt.fp32_groups_gradients[i]]
            for start, end, params in cut_buckets(sizes, flat.numel(), bucket_elements):
                b = Bucket(i, start, end, params, flat.narrow(0, start, end - start))
                self.buckets.append(b)
                for j in params:
                    self.owner[(i, j)] = b
        self.in_flight: list[Bucket] = []
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending, b.handle, b.sent, b.ready = len(b.params), None, None, [False] * len(b.params)
        self.in_flight = []

    def armed(self) -> bool:
        """This backward ends the step and its gradients are to be reduced."""
        e = self.engine
        return (e.is_gradient_accumulation_boundary() and e.enable_backward_allreduce
                and not e.inside_no_sync_ctxt)

    def accumulated(self, i: int, j: int) -> None:
        """Parameter j of group i has its gradient in the fp32 buffer: launch its bucket if complete."""
        b = self.owner[(i, j)]
        k = j - b.params[0]  # a bucket's parameters are consecutive
        if b.ready[k]:
            if b.handle is not None:
                raise RuntimeError(f"--overlap-grad-reduce: a gradient of parameter group {i} arrived "
                                   "twice in one backward, after its bucket's reduction was launched")
            return
        b.ready[k] = True
        b.pending -= 1
        if b.pending == 0:
            self.launch(b)

    def launch(self, b: Bucket) -> None:
        """Start ``b``'s all-reduce (DeepSpeed's ``allreduce_bucket`` arithmetic, asynchronously)."""
        e = self.engine
        sent = b.view if b.view.dtype == self.comm_dtype else b.view.to(self.comm_dtype)
        if e.gradient_average:
            if not e.postscale_gradients():
                sent.mul_(1.0 / self.dp_world_size)
            elif e.gradient_predivide_factor() != 1.0:
                sent.mul_(1.0 / e.gradient_predivide_factor())
        b.sent, b.handle = sent, dist.all_reduce(sent, group=self.group, async_op=True)
        self.in_flight.append(b)

    def finish(self) -> None:
        """The boundary reduction: launch what backward did not, wait for all in launch order, scale."""
        e = self.engine
        for b in self.buckets:
            if b.handle is None:
                self.launch(b)
        for b in self.in_flight:
            b.handle.wait()
            sent = b.sent
            if e.gradient_average and e.postscale_gradients() and (
                    e.gradient_predivide_factor() != self.dp_world_size):
                sent.mul_(e.gradient_predivide_factor() / self.dp_world_size)
            if sent is not b.view:
                b.view.copy_(sent)
        self._reset()


def unsupported(engine: Any) -> str | None:
    """Why the engine's bf16 reduction cannot be overlapped here (None: it can)."""
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer):
        return f"not DeepSpeed's bf16 ZeRO-1 optimizer ({type(opt).__name__})"
    if not opt.using_real_optimizer or opt.has_moe_layers:
        return "MoE layers or no optimizer"
    if not opt.immediate_grad_update:
        return ("bf16.immediate_grad_update is off in --deepspeed_config (gradients are accumulated only "
                "after backward)")
    if getattr(engine, "pipeline_parallelism", False):
        return "pipeline parallelism"
    return None


def install(engine: Any, bucket_elements: int) -> GradOverlap:
    """Overlap ``engine``'s (BF16_Optimizer, ``unsupported`` None) boundary reduction with backward in
    buckets of at least ``bucket_elements`` elements: wrap the optimizer's accumulation hook body and
    the engine's ``allreduce_gradients`` on these instances."""
    overlap = GradOverlap(engine, bucket_elements)
    opt = engine.optimizer
    accumulate = opt.accumulate_hp_grads_and_remove_lp  # DeepSpeed's hooks look it up on every call
    reduce = engine.allreduce_gradients

    def accumulate_and_launch(lp: Any, i: int, j: int) -> None:
        accumulate(lp, i, j)
        if overlap.armed():
            overlap.accumulated(i, j)

    def allreduce_gradients(*args: Any, **kwargs: Any) -> None:
        if engine.is_gradient_accumulation_boundary():
            opt.set_gradient_accumulation_boundary(True)  # as DeepSpeed's own reduction does
            overlap.finish()
        else:
            reduce(*args, **kwargs)

    opt.accumulate_hp_grads_and_remove_lp = accumulate_and_launch
    engine.allreduce_gradients = allreduce_gradients
    engine.megapost_grad_overlap = overlap
    return overlap


def installed(engine: Any) -> GradOverlap | None:
    """The engine's overlapped reduction (``install``), if any."""
    return getattr(engine, "megapost_grad_overlap", None)
