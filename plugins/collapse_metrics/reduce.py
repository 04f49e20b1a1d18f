"""The measured step's reductions across shards and ranks, on device, and its one deferred read-back.

1. Sequence parallelism only: one all-reduce over the tensor-parallel group of the packed
   per-sequence partials [row sum, sum of squares, count] (t_sim is a ratio of sums, so the
   sequence shards must be summed before it is formed; see ``similarity.py``).
2. Over the world, the flat ``StatsBuffer`` (layers a rank does not own are zero, duplicates are never
   written): one SUM all-reduce of its summed parts and one MAX all-reduce of its max parts (the
   extrema, at its end). An all-reduce leaves every rank the same values, so the running frequency
   loss and the transition detector stay identical everywhere, whichever rank's state is saved.
3. ``ReadBack``: the reduced buffer is copied to (pinned) host memory without waiting; the host reads
   it later (``ready``), when the device is long past it, so the measured step never drains the queue.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megapost.plugin_api import Collectives

from .table import StatsBuffer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_group(comm: Collectives, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Elementwise sum of ``x`` over ``group`` (x itself when there is no group)."""
    if group is None or not distributed() or dist.get_world_size(group=group) == 1:
        return x
    return comm.sum(x, group)


def reduce_buffer(comm: Collectives, buf: StatsBuffer, group: Any = None) -> torch.Tensor:
    """The flat buffer combined over ``group`` (default: the world), on its device: sums summed, the
    max parts maxed (two all-reduces; none on one rank)."""
    if not distributed():
        return buf.flat
    split = buf.max_start
    return torch.cat([comm.sum(buf.flat[:split], group), comm.max(buf.flat[split:], group)])


class ReadBack:
    """A device tensor on its way to the host: started without a sync, read by ``value()``."""

    def __init__(self, step: int, device_value: torch.Tensor) -> None:
        self.step = step
        cuda = device_value.device.type == "cuda"
        self.host = torch.empty(device_value.shape, dtype=device_value.dtype, pin_memory=cuda)
        self.host.copy_(device_value, non_blocking=cuda)
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def value(self) -> torch.Tensor:
        """The host copy, once the device has written it (waits only for that copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
