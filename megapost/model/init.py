"""Initialisation schemes, drawn from per-module generators so any partition of the model (pipeline
stages, tensor shards) reproduces the same full weights for the same seed."""

from __future__ import annotations

import math

import torch
from torch import nn

from megapost.model.config import ModelConfig
from megapost.model.norm import DyT, RMSNorm
from megapost.model.placements import deepnorm_constants

EMBEDDING_STREAM = 0
HEAD_STREAM = 1_000_000  # layer l uses stream l (1-based)


def module_generator(seed: int, stream: int) -> torch.Generator:
    """An independent CPU generator for (seed, stream)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def matrix_std(cfg: ModelConfig, role: str) -> float:
    """Std of a weight matrix by role: embed, head, q, k, v (or qkv), wo, w1, w3, w2."""
    sublayer = role not in ("embed", "head")
    role = "qkv" if role in ("q", "k", "v") else role
    if cfg.init_variance == "paper":
        var = 1.0 / (3 * (cfg.ffn_hidden_size if role == "w2" else cfg.hidden_size))
    else:
        var = cfg.init_method_std**2
        if cfg.scaled_output_init and role in ("wo", "w2"):
            var /= 2.0 * cfg.num_layers
    if sublayer:
        var *= cfg.sublayer_init_multiplier
    return math.sqrt(var)


@torch.no_grad()
def normal_(weight: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``weight`` (full, unsharded) from N(0, std^2) drawn on CPU in fp32 for reproducibility."""
    weight.copy_(torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def placement_init_multiplier(cfg: ModelConfig, role: str) -> float:
    """DeepNorm's beta on the std of W_V, W_O, W_1, W_3 and W_2 (DeepNet scales the same matrices'
    xavier gain; W_Q and W_K keep theirs); 1 otherwise."""
    if cfg.norm_position == "deepnorm" and role in ("v", "wo", "w1", "w3", "w2"):
        return deepnorm_constants(cfg.num_layers)[1]
    return 1.0


@torch.no_grad()
def init_block_(block: nn.Module, cfg: ModelConfig, seed: int, layer_number: int) -> None:
    """Matrices from the layer's own stream (same draws in every placement; DeepNorm rescales them);
    norms at identity: gains 1, DyT bias 0 and its scalar at its a_0."""
    gen = module_generator(seed, layer_number)
    attn, mlp = block.attention, block.mlp
    for role, lin in (("q", attn.wq), ("k", attn.wk), ("v", attn.wv), ("wo", attn.wo),
                      ("w1", mlp.w1), ("w3", mlp.w3), ("w2", mlp.w2)):
        normal_(lin.weight, matrix_std(cfg, role) * placement_init_multiplier(cfg, role), gen)
    for module in block.modules():
        if isinstance(module, (RMSNorm, DyT)):
            module.reset_parameters()


@torch.no_grad()
def init_embedding_(weight: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    normal_(weight, matrix_std(cfg, "embed"), module_generator(seed, EMBEDDING_STREAM))


@torch.no_grad()
def init_head_(weight: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    normal_(weight, matrix_std(cfg, "head"), module_generator(seed, HEAD_STREAM))
