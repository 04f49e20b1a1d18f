"""Parameter counts of megapost's Llama model: in total and on one (tensor, pipeline) rank."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from megapost.model import ModelConfig


def kv_groups(cfg: ModelConfig) -> int:
    """Key/value heads: ``num_query_groups`` under grouped-query attention, else the head count."""
    return getattr(cfg, "num_query_groups", None) or cfg.num_attention_heads


def kv_groups_per_rank(cfg: ModelConfig, tp: int) -> int:
    """K/V heads one TP rank holds: split when the groups divide over TP, replicated (one) otherwise."""
    return max(1, kv_groups(cfg) // tp)


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    embedding: int  # token embedding (+ DyT's embedding scalar; the untied head has as many again)
    head: int  # LM head plus the final norm (when the placement has one)
    per_layer: int  # the first block (every placement's blocks are alike in size today)

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "embedding": self.embedding, "head": self.head,
                "per_layer": self.per_layer}


def layer_parameters(cfg: ModelConfig, tp: int = 1, layer_number: int = 1) -> int:
    """Block ``layer_number`` (1-based) on one TP rank: W_Q, W_O (h x h), W_K, W_V (h x kv), W_1, W_3,
    W_2 split over TP; its norms (residual-stream and Q/K/V head norms, ``cfg.layer_norm_parameters``)
    replicated."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    kv = kv_groups_per_rank(cfg, tp) * cfg.head_dim if tp > 1 else kv_groups(cfg) * cfg.head_dim
    return 2 * h * h // tp + 2 * h * kv + 3 * h * f // tp + cfg.layer_norm_parameters(layer_number)


def _embedding_extra(cfg: ModelConfig) -> int:
    """Replicated embedding parameters besides the table: DyT's scalar."""
    return 1 if cfg.norm_kind == "dyt" else 0


def _final_norm(cfg: ModelConfig) -> int:
    return cfg.norm_parameters if cfg.final_norm else 0


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    table = cfg.vocab_size * cfg.hidden_size
    embedding = table + _embedding_extra(cfg)
    head = table + _final_norm(cfg)
    layers = sum(layer_parameters(cfg, 1, n) for n in range(1, cfg.num_layers + 1))
    return ParameterCounts(embedding + head + layers, embedding, head, layer_parameters(cfg))


@cache
def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per pipeline stage as megapost's ``type:TransformerBlockPipe`` partition assigns them:
    DeepSpeed's ``partition_balanced`` over [embedding, blocks..., head] with weight 1 per block."""
    if pp == 1:
        return (num_layers,)
    from megapost.ds_adapter.internals import partition_balanced

    parts = partition_balanced([0] + [1] * num_layers + [0], pp)
    return tuple(sum(1 for i in range(parts[s], parts[s + 1]) if 1 <= i <= num_layers) for s in range(pp))


def stage_parameters(cfg: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters one rank of pipeline ``stage`` holds (the embedding joins the first, the head the last)."""
    v_h = cfg.vocab_size * cfg.hidden_size // tp
    counts = stage_layers(cfg.num_layers, pp)
    first = sum(counts[:stage]) + 1
    n = sum(layer_parameters(cfg, tp, layer) for layer in range(first, first + counts[stage]))
    if stage == 0:
        n += v_h + _embedding_extra(cfg)
    if stage == pp - 1:
        n += v_h + _final_norm(cfg)
    return n
