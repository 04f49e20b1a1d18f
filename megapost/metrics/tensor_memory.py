"""Live tensor memory on any device, counted exactly: the bytes of every storage an op allocates,
from its creation until its last reference dies.

The CPU allocator keeps no statistics and RSS counts the interpreter, libraries, freed-but-cached
pages and numpy buffers, so neither measures tensor memory. ``LiveTensorMemory`` is a
``TorchDispatchMode``: every ATen op (forward, autograd's backward, DeepSpeed's flattening, collectives)
passes through it, and each output storage it has not seen is counted once (views share their
storage) with a ``weakref.finalize`` that uncounts it when freed. ``peak`` is then the high-water mark
of live tensor bytes — what ``torch.cuda.max_memory_allocated`` reports on a GPU, minus the caching
allocator's rounding. Storages made outside an op (``torch.from_numpy``) and those alive before the
mode was entered are not counted, so enter it before the model is built.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMemory(TorchDispatchMode):
    """``with LiveTensorMemory() as mem: ...``; then ``mem.peak``, ``mem.current`` (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self._track(value)
        return out


@contextmanager
def tensor_memory_from_env() -> Iterator[LiveTensorMemory | None]:
    """A ``LiveTensorMemory`` active for the block when ``MEGAPOST_TENSOR_MEMORY=1``, else None."""
    if os.environ.get("MEGAPOST_TENSOR_MEMORY") != "1":
        yield None
        return
    with LiveTensorMemory() as tracker:
        yield tracker
