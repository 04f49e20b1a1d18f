"""Column-parallel GEMMs whose input-gradient collective overlaps their weight-gradient GEMMs.

Megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` idea, for megapost's sublayers,
where one mapped input feeds several column-parallel projections (Q/K/V, W_1/W_3, each on its own or
packed into one GEMM by ``megapost.kernels.packed_linear``). The entry mapping of the sublayer (identity
forward / all-reduce backward, or under sequence parallelism all-gather / reduce-scatter) becomes
``_EnterDeferred``, which also takes the projections' weights as inputs; the projections multiply the
mapped input with *detached* weights, so autograd computes only their input gradients (the same nodes,
summed in the same order as before), and hand their output gradients to the entry's
``WeightGradSink``. The entry's backward then

    1. issues the all-reduce (reduce-scatter under SP) of the summed input gradient, async,
    2. computes every weight gradient (dW = dY^T X, the GEMM autograd would have run) meanwhile,
    3. waits, and returns the reduced input gradient and the weight gradients.

Autograd accumulates the weight gradients into the parameters as before (their hooks, DeepSpeed's and
the native engine's, and the fp32 gradient-accumulation fusion see the same tensors), so the numbers
are those of the unfused path bit for bit (``tests/test_async_linear.py``). The gathered input under
SP is saved as before (it already was, by the GEMMs' nodes); Megatron's re-gather in backward is not
done. The projections' output gradients live until the entry's backward (a few nodes later).

On CUDA the async collective runs on NCCL's stream; ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (set at start-up
by ``megapost.runtime.distributed.tp_overlap_env``) keeps the GPU's kernel queue in issue order, so the
collective starts before the weight-gradient GEMM takes the SMs (Megatron's requirement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megapost.parallel import collectives as C

SEQ_DIM = 1


def weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X over all tokens: [out, in], autograd's own GEMM for ``F.linear``'s weight."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class WeightGradSink:
    """The weights that read one mapped input, and the output gradients of the GEMMs that used them
    (each GEMM a list of weight indices: one, or several packed as row blocks)."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.weights = list(weights)
        self.rows = [w.shape[0] for w in self.weights]
        self.grads: list[tuple[list[int], torch.Tensor]] = []

    def index(self, weight: torch.Tensor) -> int | None:
        """Position of ``weight`` (this very tensor) among the sink's, or None."""
        return next((i for i, w in enumerate(self.weights) if w is weight), None)

    def indices(self, weights: Sequence[torch.Tensor]) -> list[int] | None:
        """Positions of all ``weights``, or None if any is not the sink's."""
        found = [self.index(w) for w in weights]
        return None if any(i is None for i in found) else found  # type: ignore[return-value]

    def add(self, indices: list[int], grad: torch.Tensor) -> None:
        self.grads.append((indices, grad))

    def collector(self, indices: list[int]) -> Any:
        """A tensor hook that hands a GEMM's output gradient to the sink."""

        def hook(grad: torch.Tensor) -> None:
            self.add(indices, grad)

        return hook

    def weight_grads(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Each weight's gradient from the collected output gradients and the mapped input ``x``."""
        out: list[torch.Tensor | None] = [None] * len(self.weights)
        for indices, grad in self.grads:
            dw = weight_grad(grad, x)
            parts = dw.split([self.rows[i] for i in indices]) if len(indices) > 1 else (dw,)
            for i, part in zip(indices, parts, strict=True):
                out[i] = part if out[i] is None else out[i] + part
        self.grads = []
        return out


class _EnterDeferred(torch.autograd.Function):
    """Entry into a column-parallel region that owns its consumers' weight gradients (module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, gather_seq: bool, sink: WeightGradSink,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.gather_seq, ctx.sink = group, gather_seq, sink
        out = C.all_gather(x, SEQ_DIM, group) if gather_seq else x.view_as(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        if ctx.gather_seq:
            pending = C.start_reduce_scatter(grad, SEQ_DIM, ctx.group)
        else:
            pending = C.start_all_reduce(grad, ctx.group)
        weight_grads = ctx.sink.weight_grads(x)  # while the collective is in flight
        return (pending.wait(), None, None, None, *weight_grads)


@torch.compiler.disable
def enter_deferred(x: torch.Tensor, group: Any, gather_seq: bool, projections: Sequence[nn.Module]
                   ) -> torch.Tensor:
    """``x`` mapped into the column-parallel region of ``projections`` (modules with
    ``effective_weight()``, megapost.parallel.layers.ColumnParallelLinear), their weight gradients
    computed by this mapping's backward while its collective is in flight. The mapped tensor carries
    the sink as ``wgrad_sink`` (read by the GEMMs: the layers, ``packed_linear``); the sink's
    ``weights`` are the tensors the GEMMs must multiply with."""
    sink = WeightGradSink([p.effective_weight() for p in projections])
    out = _EnterDeferred.apply(x, group, gather_seq, sink, *sink.weights)
    out.wgrad_sink = sink
    return out


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, sink: WeightGradSink) -> torch.Tensor:
    """``F.linear(x, weight)`` whose weight gradient goes to ``sink`` (``weight`` must be the sink's)."""
    index = sink.index(weight)
    if index is None:
        raise ValueError("deferred_linear: the weight was not given to the input's mapping")
    y = torch.nn.functional.linear(x, weight.detach())
    if y.requires_grad:
        y.register_hook(sink.collector([index]))
    return y
