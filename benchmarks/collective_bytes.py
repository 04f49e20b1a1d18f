"""Bytes handed to torch.distributed's collectives while a ``CollectiveBytes`` block is active (for
benchmarks/gpu_check.py): ``bytes``, the buffers (an all-reduce's tensor, an all-gather's full output, a
reduce-scatter's full input), and ``wire``, what a rank sends on a ring (2(n-1)/n of an all-reduce's
buffer, (n-1)/n of the others', n the group's size), the measure of megapost.plan.search.comm_parts.
DeepSpeed's comm layer and megapost's overlapped reduction look the collectives up on the module at each
call, so they are counted too."""

from __future__ import annotations

from typing import Any

import torch

# collective -> (index of the argument holding the full buffer, its keyword names, ring multiplier)
SIZED = {
    "all_reduce": (0, ("tensor",), 2), "reduce": (0, ("tensor",), 1), "broadcast": (0, ("tensor",), 1),
    "all_gather_into_tensor": (0, ("output_tensor",), 1), "_all_gather_base": (0, ("output_tensor",), 1),
    "all_gather": (0, ("tensor_list",), 1), "reduce_scatter_tensor": (1, ("input",), 1),
    "_reduce_scatter_base": (1, ("input",), 1), "reduce_scatter": (1, ("input_list",), 1),
}
COLLECTIVES = tuple(SIZED)


def _nbytes(buf: Any) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    if isinstance(buf, list | tuple):
        return sum(_nbytes(t) for t in buf)
    return 0


_ACTIVE: list[CollectiveBytes] = []  # the counters of the blocks now open


def _wrap(name: str, real: Any) -> Any:
    index, keys, ring = SIZED[name]

    def counted(*args: Any, **kw: Any) -> Any:
        if _ACTIVE:
            buf = args[index] if len(args) > index else next((kw[k] for k in keys if k in kw), None)
            size = _nbytes(buf)
            n = torch.distributed.get_world_size(kw.get("group"))
            for c in _ACTIVE:
                c.bytes += size
                c.wire += ring * (n - 1) / n * size
                c.calls += 1
        return real(*args, **kw)

    return counted


_ORIGINALS: dict[str, Any] = {}


def install() -> bool:
    """Wrap the sized collectives of ``torch.distributed`` (and its ``distributed_c10d`` twin): call it
    before DeepSpeed's communication backend is created (``deepspeed.init_distributed``), which keeps
    references to some of them (the all-gather of the updated weights). False: already wrapped."""
    import torch.distributed.distributed_c10d as c10d

    if _ORIGINALS:
        return False
    for name in SIZED:
        real = getattr(c10d, name, None)
        if real is None:
            continue
        _ORIGINALS[name] = real
        wrapped = _wrap(name, real)
        for module in (torch.distributed, c10d):
            if hasattr(module, name):
                setattr(module, name, wrapped)
    return True


def uninstall() -> None:
    import torch.distributed.distributed_c10d as c10d

    for name, real in _ORIGINALS.items():
        for module in (torch.distributed, c10d):
            if hasattr(module, name):
                setattr(module, name, real)
    _ORIGINALS.clear()


class CollectiveBytes:
    """``with CollectiveBytes() as c: ...``; then ``c.bytes``, ``c.wire`` and ``c.calls`` (wrapping the
    collectives for the block if ``install`` has not)."""

    def __init__(self) -> None:
        self.bytes, self.wire, self.calls, self._installed = 0, 0.0, 0, False

    def __enter__(self) -> CollectiveBytes:
        self._installed = install()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if self._installed:
            uninstall()
