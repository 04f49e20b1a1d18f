"""The Llama model as a DeepSpeed ``PipelineModule``: embedding, N blocks and head as layer specs.

Each spec class is the plain model's module that initialises itself from its own (seed, layer)
generator and then shards itself over tensor parallelism, so a stage builds only its own layers and
every layout reproduces the same full weights. Parameter names inside a layer are the plain model's
(``attention.wq.weight``); ``model_parameter_name`` maps a pipeline name to the ``LlamaModel`` one.

Data-iterator items are ``((tokens,), (labels, loss_mask))``: DeepSpeed feeds the first to stage 0
and the second to the loss on the last stage. Activations between stages are [b, s, h], or
[b, s/tp, h] sequence shards under --sequence-parallel (then DeepSpeed's pipe/grad partitioning must
be off, see ``megapost.parallel.deepspeed_config_overrides``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from megapost.model import Embedding, Head, ModelConfig, TransformerBlock
from megapost.model.init import init_block_
from megapost.parallel.activation_checkpoint import checkpoint_with_probes, probes_under
from megapost.parallel.parallelize import parallelize_block, parallelize_embedding, parallelize_head
from megapost.parallel.state import ParallelState

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EmbeddingPipe(Embedding):
    """First-stage layer: (tokens,) -> hidden states."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState) -> None:
        super().__init__(cfg)
        parallelize_embedding(self, pstate)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(inputs[0] if isinstance(inputs, (tuple, list)) else inputs)


class TransformerBlockPipe(TransformerBlock):
    """Block ``layer_number`` (1-based), initialised exactly as ``build_block`` does."""

    def __init__(self, cfg: ModelConfig, layer_number: int, pstate: ParallelState) -> None:
        super().__init__(cfg, layer_number)
        init_block_(self, cfg, cfg.seed, layer_number)
        parallelize_block(self, pstate)


class HeadPipe(Head):
    """Last-stage layer: hidden states -> logits (vocab-sharded under TP)."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState) -> None:
        super().__init__(cfg)
        parallelize_head(self, pstate)


class _PipeLoss:
    """Adapts ``loss_fn(logits, labels, loss_mask)`` to DeepSpeed's ``loss_fn(outputs, labels)``."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)

    def __call__(self, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.loss_fn(logits, *labels)


class LlamaPipeline(PipelineModule):
    """Pipeline stages of the Llama model over ``pstate.topology``.

    ``partition_method``: "type:TransformerBlockPipe" balances blocks (the embedding joins the first
    stage, the head the last) or "uniform" (by layer count, embedding and head counted as layers).
    Activation checkpointing recomputes every ``checkpoint_num_layers`` consecutive blocks with the
    non-reentrant checkpoint and silent probes; a segment holding the embedding or head is not
    checkpointed. Do not set DeepSpeed's ``pipeline.use_reentrant: false``: it would replace this
    checkpoint function with one that lets probes fire during recompute.
    """

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, loss_fn: LossFn,
                 checkpoint_activations: bool = False, checkpoint_num_layers: int = 1,
                 partition_method: str = "type:TransformerBlockPipe") -> None:
        specs = [LayerSpec(EmbeddingPipe, cfg, pstate)]
        specs += [LayerSpec(TransformerBlockPipe, cfg, n, pstate) for n in range(1, cfg.num_layers + 1)]
        specs.append(LayerSpec(HeadPipe, cfg, pstate))
        interval = checkpoint_num_layers if checkpoint_activations else 0
        super().__init__(
            layers=specs, topology=pstate.topology, loss_fn=_PipeLoss(loss_fn),
            partition_method=partition_method, activation_checkpoint_interval=interval,
            activation_checkpoint_func=self._checkpoint,
            checkpointable_layers=[TransformerBlockPipe.__name__],
        )
        self.config = cfg
        if interval:  # the engine does this too; needed for a forward outside the engine
            self._precompute_checkpointable_values()

    def _checkpoint(self, function: Callable[..., Any], *args: torch.Tensor) -> Any:
        # DeepSpeed hands a closure over its layer range: the stage's probes, walked once and reused
        probes = self.__dict__.get("_stage_probes")
        if probes is None:
            probes = self.__dict__["_stage_probes"] = probes_under(self)
        return checkpoint_with_probes(probes, function, *args)


def model_parameter_name(name: str, num_layers: int) -> str:
    """Pipeline parameter name -> ``LlamaModel`` name: "3.mlp.w1.weight" -> "layers.2.mlp.w1.weight"."""
    index, rest = name.split(".", 1)
    i = int(index)
    if i == 0:
        return f"embedding.{rest}"
    if i == num_layers + 1:
        return f"head.{rest}"
    return f"layers.{i - 1}.{rest}"
