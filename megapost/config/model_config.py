"""The model's ``ModelConfig`` from the flags, its vocabulary padded as the trainer pads it."""

from __future__ import annotations

import argparse

from megapost.config.errors import ConfigError
from megapost.model.config import ModelConfig, padded_vocab_size


def model_vocab_size(args: argparse.Namespace, tokenizer_vocab: int) -> int:
    """--load-hf's vocabulary (which must cover the tokenizer's), else the tokenizer's padded to a
    multiple of --make-vocab-size-divisible-by."""
    hf_vocab = getattr(args, "hf_vocab_size", None)
    if hf_vocab is not None and hf_vocab < tokenizer_vocab:
        raise ConfigError(f"--load-hf {args.load_hf} has vocab_size {hf_vocab} but --tokenizer-model "
                          f"{args.tokenizer_model} has {tokenizer_vocab} tokens; pass the model's tokenizer")
    return hf_vocab or padded_vocab_size(tokenizer_vocab, args.make_vocab_size_divisible_by)


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """``vocab_size``: the tokenizer's (unpadded). Raises ValueError for an invalid model."""
    return ModelConfig(
        vocab_size=model_vocab_size(args, vocab_size),
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
        norm_position=args.norm_position, mix_post_fraction=args.mix_post_fraction,
        dyt_alpha_init=tuple(args.dyt_alpha_init), qk_norm=args.qk_norm,
        norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        init_variance=args.init_variance, init_method_std=args.init_method_std,
        scaled_output_init=args.scaled_output_init, sublayer_init_multiplier=args.init_sublayer_multiplier,
        prefix_alpha=args.prefix_alpha, seed=args.seed,
    )
