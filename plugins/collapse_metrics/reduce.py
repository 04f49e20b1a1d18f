"""The measured step's reductions across shards and ranks: at most two collectives, on device.

1. Sequence parallelism only: one all-reduce over the tensor-parallel group of the packed
   per-sequence partials [row sum, sum of squares, count] (t_sim is a ratio of sums, so the
   sequence shards must be summed before it is formed; see ``similarity.py``).
2. One all-gather over the world of the flat ``StatsBuffer`` (layers a rank does not own are zero,
   duplicates are never written), combined on every rank by sum or max per part. Gathering instead of
   all-reducing lets minima/maxima share the collective with the sums, and gives every rank the same
   reduced values (the running frequency loss and the transition detector stay identical everywhere,
   whichever rank's plugin state is checkpointed).
The result is copied to the host once: the step's only synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megapost.plugin_api import all_gather, all_reduce

from .table import StatsBuffer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Elementwise sum of ``x`` over ``group`` (x itself when there is no group)."""
    if group is None or not distributed() or dist.get_world_size(group=group) == 1:
        return x
    return all_reduce(x, group)


def reduce_buffer(buf: StatsBuffer, group: Any = None) -> torch.Tensor:
    """The flat buffer combined over ``group`` (default: the world), as a CPU float64 tensor."""
    gathered = buf.flat[None]
    if distributed():
        gathered = all_gather(gathered, 0, group)
    return buf.combine(gathered).cpu()
