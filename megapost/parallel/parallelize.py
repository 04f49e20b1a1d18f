"""Turn the plain model's modules into tensor-(and sequence-)parallel ones, in place.

Attention: W_Q, W_K, W_V column-parallel (heads split over TP), W_O row-parallel. With grouped-query
attention the K/V heads are split like the query heads when the groups divide over TP; with fewer
groups than TP ranks each rank keeps the one K/V head its query heads read (query heads are split
in order, so the tp / groups ranks of a group are consecutive) and those ranks sum its gradient.
SwiGLU: W_1, W_3 column-parallel, W_2 row-parallel. The input of each sublayer is mapped once, by a
forward pre-hook on the attention/MLP module, and shared by its column-parallel projections:
``copy_to_tp_region``, or under sequence parallelism ``gather_from_sequence_region``, so attention
sees the full sequence (RoPE and the prefix-averaging intervention need no change). Row-parallel
outputs are all-reduced, or reduce-scattered back into sequence shards. With
``pstate.async_tensor_model_parallel_allreduce`` (the default; Megatron's
--no-async-tensor-model-parallel-allreduce turns it off) that mapping's backward computes the
column-parallel weight gradients while its collective is in flight (megapost.parallel.async_linear).

Under sequence parallelism the residual stream, the RMSNorms and the probes between sublayers work on
[b, s/tp, h]; the embedding output is reduce-scattered into those shards and the head all-gathers its
input. The norm gains then see only this rank's tokens, so their gradients are all-reduced over TP by
a gradient hook (``mark_sequence_parallel``) before DeepSpeed accumulates them. The per-head norm gains
of --qk-norm / HybridNorm are shared by all heads, so a rank sees only its heads' part of their
gradient: they get the same hook under any tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from megapost.model import Embedding, Head, TransformerBlock
from megapost.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    map_column_input,
    mark_sequence_parallel,
)
from megapost.parallel.layout import TP_FLAG
from megapost.parallel.state import ParallelState


def _map_input_once(module: nn.Module, pstate: ParallelState,
                    projections: Callable[[], list[ColumnParallelLinear]]) -> None:
    """Apply the TP-region entry mapping to ``module``'s first positional input, shared by its
    column-parallel ``projections()``."""
    group, sp = pstate.tp_group, pstate.sequence_parallel
    overlap = pstate.async_tensor_model_parallel_allreduce

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (map_column_input(args[0], group, sp, projections(), overlap), *args[1:])

    module.register_forward_pre_hook(hook)


def _column(linear: nn.Module, pstate: ParallelState, replicas: int = 1) -> ColumnParallelLinear:
    return ColumnParallelLinear(linear, pstate.tp_group, input_mapping=None, replicas=replicas)


def _row(linear: nn.Module, pstate: ParallelState) -> RowParallelLinear:
    return RowParallelLinear(linear, pstate.tp_group, sequence_parallel=pstate.sequence_parallel)


def parallelize_block(block: TransformerBlock, pstate: ParallelState) -> TransformerBlock:
    """Shard ``block``'s attention and MLP over ``pstate.tp_group``; returns the same block."""
    attn, mlp = block.attention, block.mlp
    if pstate.tp_size == 1 or isinstance(attn.wo, RowParallelLinear):  # nothing to do, or done already
        return block
    tp = pstate.tp_size
    heads, groups = attn.wq.out_features // attn.head_dim, attn.wk.out_features // attn.head_dim
    if heads % tp:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by {TP_FLAG} {tp}")
    if groups % tp and tp % groups:
        raise ValueError(f"--num-query-groups {groups} and {TP_FLAG} {tp}: one must divide the other")
    kv_replicas = max(tp // groups, 1)
    attn.wq = _column(attn.wq, pstate)
    attn.wk, attn.wv = _column(attn.wk, pstate, kv_replicas), _column(attn.wv, pstate, kv_replicas)
    attn.wo = _row(attn.wo, pstate)
    mlp.w1, mlp.w3 = _column(mlp.w1, pstate), _column(mlp.w3, pstate)
    mlp.w2 = _row(mlp.w2, pstate)
    _map_input_once(attn, pstate, lambda: [attn.wq, attn.wk, attn.wv])
    _map_input_once(mlp, pstate, lambda: [mlp.w1, mlp.w3])
    for head_norm in (attn.q_norm, attn.k_norm, attn.v_norm):  # one gain over this rank's heads only
        if head_norm is not None:
            mark_sequence_parallel(head_norm.weight, pstate.tp_group)
    if pstate.sequence_parallel:
        for norm in (block.attention_norm, block.attention_out_norm, block.mlp_norm, block.mlp_out_norm):
            for param in norm.parameters() if norm is not None else ():
                mark_sequence_parallel(param, pstate.tp_group)
    return block


def parallelize_embedding(embedding: Embedding, pstate: ParallelState) -> Embedding:
    """Split the vocabulary rows over TP; under SP the output is this rank's sequence shard."""
    if pstate.tp_size > 1 and not isinstance(embedding.word_embeddings, VocabParallelEmbedding):
        embedding.word_embeddings = VocabParallelEmbedding(
            embedding.word_embeddings, pstate.tp_group, sequence_parallel=pstate.sequence_parallel)
        if pstate.sequence_parallel and embedding.scale is not None:
            mark_sequence_parallel(embedding.scale, pstate.tp_group)
    return embedding


def parallelize_head(head: Head, pstate: ParallelState) -> Head:
    """Column-parallel LM head producing vocab-sharded logits [b, s, vocab/tp] (no gather)."""
    if pstate.tp_size == 1 or isinstance(head.lm_head, ColumnParallelLinear):
        return head
    head.lm_head = ColumnParallelLinear(
        head.lm_head, pstate.tp_group, input_mapping="gather_seq" if pstate.sequence_parallel else "copy",
        overlap=pstate.async_tensor_model_parallel_allreduce)
    if pstate.sequence_parallel and head.final_norm is not None:
        for param in head.final_norm.parameters():
            mark_sequence_parallel(param, pstate.tp_group)
    return head
