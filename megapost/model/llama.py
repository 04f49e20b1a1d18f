"""The Llama decoder as three composable stages: embedding, transformer blocks, head."""

from __future__ import annotations

import math

import torch
from torch import nn

from megapost.model.block import TransformerBlock
from megapost.model.config import ModelConfig
from megapost.model.fusion import Fusion
from megapost.model.init import init_block_, init_embedding_, init_head_
from megapost.model.loss import HeadOutput
from megapost.model.norm import make_norm
from megapost.model.probe import Probe


class Embedding(nn.Module):
    """Token embedding (times a learned scalar, init sqrt(d), under DyT); its output is X_1^1."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.scale = (nn.Parameter(torch.full((1,), math.sqrt(cfg.hidden_size)))
                      if cfg.embedding_scale else None)
        self.probe = Probe(("embed",))
        init_embedding_(self.word_embeddings.weight, cfg, cfg.seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)
        self.probe(x=x)
        return x


class LMHead(nn.Linear):
    """The untied, bias-free LM head; ``self(x, True)`` returns a ``HeadOutput`` (its input and weight)
    instead of logits, for a loss that computes them chunk by chunk. A module call either way, so hooks on
    it (the distributed optimizer's wait for its parameter gather) run."""

    def forward(self, x: torch.Tensor, defer: bool = False) -> torch.Tensor | HeadOutput:
        return HeadOutput(x, self.weight) if defer else super().forward(x)


class Head(nn.Module):
    """Final norm (unless the last block already ends in one, as Post-Norm's does) and untied LM head.
    With ``returns_head_output`` (set by a builder whose loss takes a ``HeadOutput``) and the ``ce``
    fusion on, it returns its input and weight, not logits: the loss runs the chunked head + CE."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.final_norm = (make_norm(cfg.norm_kind, cfg.hidden_size, cfg.norm_eps, cfg.dyt_alpha_init[1])
                           if cfg.final_norm else None)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.probe = Probe(("head",))
        self.fusion = Fusion()  # megapost.model.fusion.set_kernel_fusion
        self.returns_head_output = False
        init_head_(self.lm_head.weight, cfg, cfg.seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor | HeadOutput:
        if self.final_norm is not None:
            x = self.final_norm(x)
        self.probe(x=x)
        if (self.returns_head_output and type(self.lm_head) is LMHead and self.fusion.on("ce", x.dtype)
                and not torch.compiler.is_compiling()):
            return self.lm_head(x, True)
        return self.lm_head(x)


def build_block(cfg: ModelConfig, layer_number: int) -> TransformerBlock:
    """A block initialised from its own (seed, layer) stream."""
    block = TransformerBlock(cfg, layer_number)
    init_block_(block, cfg, cfg.seed, layer_number)
    return block


class LlamaModel(nn.Module):
    """tokens [b, s] -> logits [b, s, vocab]. Knows nothing of parallelism, DeepSpeed or metrics."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embedding = Embedding(cfg)
        self.layers = nn.ModuleList(build_block(cfg, i + 1) for i in range(cfg.num_layers))
        self.head = Head(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
