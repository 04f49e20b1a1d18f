"""Which slice of a full parameter a tensor-parallel piece is: from the split its layer declared
(:class:`megapost.parallel.shard_spec.ShardSpec`, recorded by the writer since format 3); inferred from
shapes (:func:`infer_split`) only for a parameter no layer declared and in checkpoints from before specs
(format 2 recorded the inferred ``dim``/``offset``, which are read as given)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megapost.model import LlamaModel, ModelConfig
from megapost.parallel.shard_spec import REPLICATED, ShardSpec, spec_of


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The single-process model's parameter names and shapes (built on the meta device)."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def local_parameters(module: nn.Module, num_layers: int, pipeline: bool) -> dict[str, nn.Parameter]:
    """This rank's parameters under their ``LlamaModel`` names (DeepSpeed's pipeline module names them
    by layer index; the native engine's stages, ``llama_names``, as ``LlamaModel`` already)."""
    if not pipeline or getattr(module, "llama_names", False):
        return dict(module.named_parameters())
    from megapost.parallel.pipeline import model_parameter_name

    return {model_parameter_name(name, num_layers): p for name, p in module.named_parameters()}


def infer_split(local: tuple[int, ...], full: tuple[int, ...], tp_rank: int, tp_size: int,
                name: str) -> tuple[int | None, int]:
    """(split dim or None, offset) of a local shard no layer declared, from shapes: a dimension holding
    ``full/local`` distinct contiguous pieces spread evenly over the TP ranks (``full/local == tp``:
    plain sharding; fewer: pieces replicated over adjacent ranks)."""
    if local == full:
        return None, 0
    dims = [d for d, (a, b) in enumerate(zip(local, full, strict=True)) if a != b]
    if len(dims) != 1 or full[dims[0]] % local[dims[0]]:
        raise ValueError(f"{name}: local shape {local} is not a shard of the full shape {full}")
    d = dims[0]
    pieces = full[d] // local[d]
    return d, (tp_rank * pieces // tp_size) * local[d]


def local_spec(p: nn.Parameter, full: tuple[int, ...], tp_rank: int, tp_size: int,
               name: str) -> tuple[ShardSpec, int]:
    """(spec, offset along its dim) of this rank's piece ``p`` of a parameter of shape ``full``: its
    layer's declaration; a parameter no layer split is replicated when whole, inferred otherwise."""
    local = tuple(p.shape)
    spec = spec_of(p)
    if spec is None:
        if local == full:
            return REPLICATED, 0
        dim, offset = infer_split(local, full, tp_rank, tp_size, name)
        return ShardSpec(dim, tp_size * local[dim] // full[dim] if dim is not None else 1), offset
    if spec.dim is None and local != full:
        raise ValueError(f"{name}: declared replicated but local shape {local} != full shape {full}")
    return spec, spec.offset(local, tp_rank)


def piece_split(entry: dict[str, Any], tp_rank: int) -> tuple[int | None, int]:
    """(dim, offset) of a saved piece from its header ``entry``: its recorded spec (format 3), else the
    ``dim``/``offset`` the writer inferred (formats 1-2)."""
    if "spec" in entry:
        spec = ShardSpec.from_json(entry["spec"])
        return spec.dim, spec.offset(tuple(entry["local"]), tp_rank)
    return entry["dim"], entry["offset"]
