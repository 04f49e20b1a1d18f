"""Checks that a (tensor, pipeline, data) layout fits the model, and vocabulary padding."""

from __future__ import annotations

from megapost.model.config import ModelConfig, padded_vocab_size

__all__ = ["layout_errors", "padded_vocab_size", "validate_layout"]

TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"


def layout_errors(cfg: ModelConfig, tp: int, pp: int, sequence_parallel: bool, seq_length: int,
                  world_size: int) -> list[str]:
    """One line per reason the layout cannot run; empty when it can."""
    if tp < 1 or pp < 1:
        return [f"{TP_FLAG} ({tp}) and {PP_FLAG} ({pp}) must be >= 1"]
    errors = []
    if world_size % (tp * pp):
        errors.append(f"world size {world_size} is not divisible by {TP_FLAG} {tp} x {PP_FLAG} {pp}")
    if cfg.num_attention_heads % tp:
        errors.append(f"--num-attention-heads {cfg.num_attention_heads} is not divisible by {TP_FLAG} {tp}")
    groups = cfg.kv_groups
    if groups % tp and tp % groups:
        errors.append(f"--num-query-groups {groups} and {TP_FLAG} {tp}: one must divide the other (K/V heads "
                      "are split over TP ranks, or replicated when fewer)")
    if cfg.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {cfg.ffn_hidden_size} is not divisible by {TP_FLAG} {tp}")
    if cfg.vocab_size % tp:
        errors.append(f"padded vocab size {cfg.vocab_size} is not divisible by {TP_FLAG} {tp}; "
                      f"use a --make-vocab-size-divisible-by that is a multiple of {tp}")
    if cfg.num_layers < pp:
        errors.append(f"--num-layers {cfg.num_layers} is less than {PP_FLAG} {pp} (each stage needs a layer)")
    if sequence_parallel and tp > 1 and seq_length % tp:
        errors.append(f"--seq-length {seq_length} is not divisible by {TP_FLAG} {tp} (--sequence-parallel "
                      "splits the sequence over tensor-parallel ranks)")
    return errors


def validate_layout(cfg: ModelConfig, tp: int, pp: int, sequence_parallel: bool, seq_length: int,
                    world_size: int) -> None:
    """Raise ``ValueError`` listing every reason the layout cannot run (one line each)."""
    errors = layout_errors(cfg, tp, pp, sequence_parallel, seq_length, world_size)
    if errors:
        raise ValueError("invalid parallel layout:\n  " + "\n  ".join(errors))
