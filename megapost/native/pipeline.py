"""Pipeline parallelism of the native engine (``--use-distributed-optimizer`` with
``--pipeline-model-parallel-size`` > 1): this rank's chunks of megapost's parallel model, run by
``torch.distributed.pipelining``'s 1F1B or, under Megatron's ``--num-layers-per-virtual-pipeline-stage``,
its interleaved 1F1B (virtual stages).

A model of L layers on ``pp`` ranks with ``virtual`` chunks per rank is cut into ``pp * virtual`` chunks
of L / (pp * virtual) consecutive layers; chunk k lives on pipeline rank k % pp (Megatron's order: rank r
holds chunks r, r + pp, r + 2 pp, ...), the embedding in chunk 0, the head in the last chunk. ``virtual``
1 is plain 1F1B. ``StageModel`` builds only this rank's layers (each initialised from its own (seed,
layer) stream and sharded over TP, as ``ParallelLlamaModel`` builds them), its parameters named as
``LlamaModel``'s; ``PipelineRunner`` runs one step's micro-batches through the schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from megapost.model import Embedding, Head, ModelConfig
from megapost.model.llama import build_block
from megapost.parallel.activation_checkpoint import checkpoint_with_probes, probes_under
from megapost.parallel.parallelize import parallelize_block, parallelize_embedding, parallelize_head
from megapost.parallel.state import ParallelState


class Chunk(nn.Module):
    """``layers`` (consecutive blocks), after ``embedding`` and before ``head`` where given; with
    ``checkpoint`` > 0 every ``checkpoint`` blocks are recomputed in backward (probes silent then)."""

    def __init__(self, embedding: nn.Module | None, layers: Sequence[nn.Module], head: nn.Module | None,
                 checkpoint: int = 0) -> None:
        super().__init__()
        self.embedding, self.layers, self.head = embedding, nn.ModuleList(layers), head
        self.checkpoint = checkpoint

    @classmethod
    def of(cls, model: nn.Module, start: int, stop: int) -> Chunk:
        """Layers ``[start, stop)`` of ``model`` (its ``embedding``, ``layers`` and ``head``)."""
        n = len(model.layers)
        return cls(model.embedding if start == 0 else None, model.layers[start:stop],
                   model.head if stop == n else None)

    def _run(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        n, k = len(self.layers), self.checkpoint
        if k:
            for start in range(0, n, k):
                probes = probes_under(*self.layers[start:start + k])
                x = checkpoint_with_probes(probes, partial(self._run, start, start + k), x)
        else:
            x = self._run(0, n, x)
        return self.head(x) if self.head is not None else x


def chunk_indices(num_layers: int, pp: int, virtual: int, rank: int) -> list[tuple[int, int, int]]:
    """(stage index, first layer, end layer) of each chunk of pipeline rank ``rank``."""
    stages = pp * virtual
    if num_layers % stages:
        raise ValueError(f"{num_layers} layers do not split into {pp} x {virtual} equal chunks")
    per = num_layers // stages
    return [(k, k * per, (k + 1) * per) for k in range(rank, stages, pp)]


class StageModel(nn.Module):
    """Pipeline rank ``pstate.pp_rank``'s part of megapost's parallel model: the blocks of its chunks
    (``layers`` keyed by their 0-based index in the whole model, so parameter names are ``LlamaModel``'s:
    ``layers.5.mlp.w1.weight``), the embedding on the rank of chunk 0, the head on the rank of the last
    chunk; ``chunks`` (not submodules: they hold the same modules) in stage order, with their stage
    indices in ``stage_ids``."""

    llama_names = True  # megapost.checkpoint.specs.local_parameters: the names are LlamaModel's

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, virtual: int = 1,
                 checkpoint_num_layers: int = 0) -> None:
        super().__init__()
        self.config = cfg
        ranges = chunk_indices(cfg.num_layers, pstate.pp_size, virtual, pstate.pp_rank)
        first, last = ranges[0][1] == 0, ranges[-1][2] == cfg.num_layers
        self.embedding = parallelize_embedding(Embedding(cfg), pstate) if first else None
        self.layers = nn.ModuleDict({str(n): parallelize_block(build_block(cfg, n + 1), pstate)
                                     for _k, start, stop in ranges for n in range(start, stop)})
        self.head = parallelize_head(Head(cfg), pstate) if last else None
        self.stage_ids = [k for k, _a, _b in ranges]
        chunks = [Chunk(self.embedding if start == 0 else None,
                        [self.layers[str(n)] for n in range(start, stop)],
                        self.head if stop == cfg.num_layers else None, checkpoint_num_layers)
                  for _k, start, stop in ranges]
        self.__dict__["chunks"] = chunks  # not registered: the modules are this model's already


def _stage_io(cfg: ModelConfig, pstate: ParallelState, micro_batch: int, dtype: torch.dtype,
              stages: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Stage k's (input, output) of one micro-batch as meta tensors: tokens [b, s] into stage 0, hidden
    states [b, s, h] ([b, s / tp, h] under sequence parallelism) between stages, vocab-sharded logits
    [b, s, vocab / tp] out of the last. Given to the stages, the schedule runs no forward to infer them."""
    seq = cfg.seq_length // pstate.tp_size if pstate.sequence_parallel else cfg.seq_length
    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    hidden = meta(micro_batch, seq, cfg.hidden_size)
    tokens = meta(micro_batch, cfg.seq_length, dtype=torch.long)
    logits = meta(micro_batch, cfg.seq_length, cfg.vocab_size // pstate.tp_size)
    return lambda k: (tokens if k == 0 else hidden, logits if k == stages - 1 else hidden)


def pack_target(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One tensor the schedule splits into micro-batches: [..., 0] the labels, [..., 1] the 0/1 mask."""
    return torch.stack([labels, loss_mask.to(labels.dtype)], dim=-1)


def make_schedule(stages: list[PipelineStage], micro_batches: int, loss: Callable[..., torch.Tensor],
                  scale_grads: bool = True) -> Any:
    """``ScheduleInterleaved1F1B`` over several stages of this rank, ``Schedule1F1B`` over one; with
    fewer micro-batches than stages (torch's 1F1B refuses them) ``ScheduleGPipe``: all forwards, then all
    backwards (what 1F1B does then anyway, each chunk's gradients added in the same order)."""
    if len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss, scale_grads=scale_grads)
    single = Schedule1F1B if micro_batches >= stages[0].num_stages else ScheduleGPipe
    return single(stages[0], micro_batches, loss_fn=loss, scale_grads=scale_grads)


def build_schedule(model: nn.Module, pp: int, virtual: int, rank: int, group: Any, device: torch.device,
                   micro_batches: int, loss_fn: Callable[..., torch.Tensor]) -> tuple[Any, list[Chunk]]:
    """The schedule over this rank's chunks of a whole ``model`` (every layer built) on the pipeline
    ``group``, with ``loss_fn(logits, labels, loss_mask)`` on the last stage's output and
    ``pack_target``'s target; and the chunks. ``schedule.step(tokens, target=..., losses=[])`` runs one
    step of ``micro_batches``."""
    chunks, stages = [], []
    for k, start, stop in chunk_indices(len(model.layers), pp, virtual, rank):
        chunk = Chunk.of(model, start, stop).to(device)
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, k, pp * virtual, device, group=group))

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, target[..., 0], target[..., 1].to(logits.dtype))

    return make_schedule(stages, micro_batches, loss), chunks


class PipelineRunner:
    """One step's ``micro_batches`` of ``model`` (a ``StageModel``) through the schedule on
    ``pstate.pp_group``: each micro-batch's loss divided by their count on the last stage (the schedule
    scales nothing: the distributed optimizer's hooks take the gradients as they land);
    ``before_backward(last)`` is called before each chunk's backward of a micro-batch, ``last`` for
    the step's last one (the optimizer then reduce-scatters a bucket as soon as its gradients are in).
    The returned loss is the mean over micro-batches, broadcast from the last stage over the pipeline
    group (the caller takes the data-parallel mean)."""

    def __init__(self, model: StageModel, pstate: ParallelState, micro_batches: int, micro_batch_size: int,
                 loss_fn: Callable[..., torch.Tensor], device: torch.device,
                 before_backward: Callable[[bool], None]) -> None:
        self.model, self.count, self.loss_fn, self.device = model, micro_batches, loss_fn, device
        self.group = pstate.pp_group
        self.last_rank = dist.get_global_rank(self.group, pstate.pp_size - 1)
        self.seen: list[torch.Tensor] = []
        n = pstate.pp_size * len(model.chunks)
        shapes = _stage_io(model.config, pstate, micro_batch_size, next(model.parameters()).dtype, n)
        stages = [PipelineStage(chunk, k, n, device, *shapes(k), group=self.group)
                  for k, chunk in zip(model.stage_ids, model.chunks, strict=True)]
        for stage in stages:
            stage.backward_one_chunk = self._marked(stage.backward_one_chunk, before_backward)
        self.schedule = make_schedule(stages, micro_batches, self._loss, scale_grads=False)
        self.holds_loss = any(s.is_last for s in stages)

    def _marked(self, backward: Callable[..., Any], before: Callable[[bool], None]) -> Callable[..., Any]:
        def call(bwd_chunk_id: int, *args: Any, **kw: Any) -> Any:
            before(bwd_chunk_id == self.count - 1)
            return backward(bwd_chunk_id, *args, **kw)
        return call

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, target[..., 0], target[..., 1].to(logits.dtype))
        self.seen.append(loss.detach().float())
        return loss / self.count

    def run(self, micro_batches: Iterator[Any], backward: bool) -> torch.Tensor:
        """Forward (and backward) of the step's micro-batches; the mean loss on every pipeline rank."""
        batches = [next(micro_batches) for _ in range(self.count)]
        tokens = torch.cat([b["tokens"] for b in batches])
        target = pack_target(torch.cat([b["labels"] for b in batches]),
                             torch.cat([b["loss_mask"] for b in batches]))
        self.seen = []
        run = self.schedule.step if backward else self.schedule.eval
        run(tokens, target=target, losses=[], return_outputs=False)
        loss = torch.stack(self.seen).mean() if self.holds_loss else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss
