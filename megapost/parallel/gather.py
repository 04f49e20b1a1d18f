"""Reassemble the full model's parameters from tensor shards and pipeline stages (for tests,
debugging and conversion; it materialises the whole model on every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megapost.parallel import collectives as C
from megapost.parallel.state import ParallelState


def full_state_dict(model: nn.Module, pstate: ParallelState) -> dict[str, torch.Tensor]:
    """``LlamaModel``-named full parameters (CPU copies), identical on every rank. Collective over the
    tensor- and pipeline-parallel groups: call it on every rank. ``model`` is this rank's module
    (``ParallelLlamaModel`` or ``LlamaPipeline``, not the DeepSpeed engine)."""
    rename = (lambda name: name)
    if pstate.pp_size > 1 and not getattr(model, "llama_names", False):  # DeepSpeed's layer-index names
        from megapost.parallel.pipeline import model_parameter_name

        num_layers = model.config.num_layers
        rename = (lambda name: model_parameter_name(name, num_layers))
    local = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(param, "partition_dim") and pstate.tp_size > 1:
            tensor = C.all_gather(tensor, param.partition_dim, pstate.tp_group)
            replicas = getattr(param, "partition_replicas", 1)  # keep one copy of each replicated slice
            if replicas > 1:
                tensor = torch.cat(tensor.chunk(pstate.tp_size, param.partition_dim)[::replicas],
                                   param.partition_dim)
        local[rename(name)] = tensor.cpu().clone()
    if pstate.pp_size == 1:
        return local
    stages: list[dict[str, torch.Tensor] | None] = [None] * pstate.pp_size
    dist.all_gather_object(stages, local, group=pstate.pp_group)
    return {name: t for stage in stages for name, t in stage.items()}
