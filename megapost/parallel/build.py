"""Build this rank's part of the model for a layout: a module and its loss function."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from megapost.model import Embedding, Head, ModelConfig, build_block
from megapost.parallel.activation_checkpoint import checkpoint_with_probes, probes_under
from megapost.parallel.cross_entropy import vocab_parallel_lm_loss
from megapost.parallel.layout import validate_layout
from megapost.parallel.parallelize import parallelize_block, parallelize_embedding, parallelize_head
from megapost.parallel.state import ParallelState

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelLlamaModel(nn.Module):
    """``LlamaModel`` (same submodules, parameter names and initial weights) sharded over tensor
    parallelism; each module is built full size, initialised and sharded before the next is built.
    tokens [b, s] -> logits [b, s, vocab/tp] (inside ``head_output()``, at TP 1 under --kernel-fusion
    ce, a ``HeadOutput`` for ``LMLoss`` to compute them chunk by chunk). With ``checkpoint_activations`` every
    ``checkpoint_num_layers`` blocks are recomputed in backward (non-reentrant; probes do not fire
    during the recompute)."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, checkpoint_activations: bool = False,
                 checkpoint_num_layers: int = 1) -> None:
        super().__init__()
        if checkpoint_num_layers < 1:
            raise ValueError(f"--checkpoint-num-layers must be >= 1, got {checkpoint_num_layers}")
        self.config = cfg
        self.checkpoint_activations = checkpoint_activations
        self.checkpoint_num_layers = checkpoint_num_layers
        self.embedding = parallelize_embedding(Embedding(cfg), pstate)
        self.layers = nn.ModuleList(parallelize_block(build_block(cfg, n), pstate)
                                    for n in range(1, cfg.num_layers + 1))
        self.head = parallelize_head(Head(cfg), pstate)

    @contextmanager
    def head_output(self) -> Iterator[None]:
        """Forward passes whose output goes to ``LMLoss`` (the step runner's): the head may return a
        ``HeadOutput`` (``Head``); any other caller of the model gets logits."""
        self.head.returns_head_output = True
        try:
            yield
        finally:
            self.head.returns_head_output = False

    def _segment_probes(self, start: int, stop: int) -> list:
        """The probes of layers [start, stop), walked once (not the whole model per segment: O(L^2))."""
        cache = self.__dict__.setdefault("_probe_cache", {})
        if (start, stop) not in cache:
            cache[start, stop] = probes_under(*self.layers[start:stop])
        return cache[start, stop]

    def _run(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        n, k = len(self.layers), self.checkpoint_num_layers
        if self.checkpoint_activations:
            for start in range(0, n, k):
                segment = partial(self._run, start, start + k)
                x = checkpoint_with_probes(self._segment_probes(start, start + k), segment, x)
        else:
            x = self._run(0, n, x)
        return self.head(x)


class LMLoss:
    """``loss_fn(logits, labels, loss_mask)`` -> scalar mean CE over the mask, identical on every TP
    rank; logits may be vocab-sharded over ``pstate.tp_group``. ``z_loss``: PaLM's auxiliary
    coefficient, in the gradient only (``megapost.model.loss.masked_lm_loss``); each call's z term is
    kept until ``take_z_terms`` (on the ranks that compute the loss: the last pipeline stage)."""

    __name__ = "lm_loss"

    def __init__(self, pstate: ParallelState, z_loss: float = 0.0) -> None:
        self.group = pstate.tp_group if pstate.tp_size > 1 else None
        self.z_loss = z_loss
        self.z_terms: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lm_loss(logits, labels, loss_mask, self.group, self.z_loss, self.z_terms)

    def take_z_terms(self) -> list[torch.Tensor]:
        terms, self.z_terms = self.z_terms, []
        return terms


def make_loss_fn(pstate: ParallelState, z_loss: float = 0.0) -> LossFn:
    """An ``LMLoss`` for this rank's tensor-parallel group."""
    return LMLoss(pstate, z_loss)


def build_model(cfg: ModelConfig, pstate: ParallelState, checkpoint_activations: bool = False,
                checkpoint_num_layers: int = 1, partition_method: str = "type:TransformerBlockPipe",
                z_loss: float = 0.0) -> tuple[nn.Module, LossFn]:
    """(model, loss_fn) for this rank. ``cfg.vocab_size`` must already be padded (``padded_vocab_size``).

    pp_size == 1: a ``ParallelLlamaModel``; call ``loss_fn(model(tokens), labels, loss_mask)``.
    pp_size > 1: a ``parallel.pipeline.LlamaPipeline`` (a DeepSpeed ``PipelineModule`` with ``loss_fn``
    built in) holding only this stage's layers; train it with ``engine.train_batch(data_iter)``.
    """
    validate_layout(cfg, pstate.tp_size, pstate.pp_size, pstate.sequence_parallel, cfg.seq_length,
                    pstate.world_size)
    loss_fn = make_loss_fn(pstate, z_loss)
    if pstate.pp_size == 1:
        return ParallelLlamaModel(cfg, pstate, checkpoint_activations, checkpoint_num_layers), loss_fn
    from megapost.parallel.pipeline import LlamaPipeline  # imports deepspeed.pipe

    return LlamaPipeline(cfg, pstate, loss_fn, checkpoint_activations, checkpoint_num_layers,
                         partition_method), loss_fn
