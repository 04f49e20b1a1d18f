"""Count the calls that make the host wait for the device, with their call sites.

On CUDA a host sync is a device read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
``.numpy()``, a blocking copy to the CPU) or an explicit ``synchronize()``. On a CPU rank the same calls
cost nothing, so ``HostSyncCounter`` counts the calls that *would* sync on CUDA: every
``aten._local_scalar_dense`` (``.item()`` / ``float`` / ``bool`` / ``int`` reach it) by dispatch, every
``aten._to_copy`` to the CPU of a non-CPU tensor by dispatch, and, by patching, ``Tensor.tolist`` /
``.cpu`` / ``.numpy`` / ``.to("cpu")``, ``torch.tensor(..., device=...)`` (a blocking host-to-device copy
on CUDA) and DeepSpeed's and torch's ``synchronize()``. On a CPU rank the accelerator device is the
CPU, so a ``.to(accelerator device)`` (a no-op on CUDA) counts as ``to_cpu`` too: a strict count.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default


def _call_site() -> str:
    """The innermost frame outside this file and torch's own modules: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if name.endswith("metrics/host_syncs.py") or "/torch/" in name:
            continue
        return f"{name.split('site-packages/')[-1]}:{frame.lineno} ({frame.name})"
    return "?"


def _to_cpu(args: tuple, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("non_blocking"):
        return False
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            device = a
    return device is not None and torch.device(device).type == "cpu"


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SCALAR:
            self.counter.record("item")
        elif (func is _TO_COPY and kwargs.get("device") is not None and torch.device(kwargs["device"]).type
              == "cpu" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"):
            self.counter.record("copy_to_cpu")
        return func(*args, **kwargs)


class HostSyncCounter:
    """``with HostSyncCounter() as c: ...``; then ``c.total`` and ``c.sites`` (Counter of
    ``"kind @ file:line (function)"``). ``pause()`` / ``resume()`` stop and restart the counting."""

    _METHODS = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _Dispatch | None = None
        self.active = False

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def record(self, kind: str) -> None:
        if self.active:
            self.sites[f"{kind} @ {_call_site()}"] += 1

    def _patch(self, owner: Any, name: str, kind: str, only_if: Any = None) -> None:
        original = getattr(owner, name)
        counter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if only_if is None or only_if(args[1:], kwargs):
                counter.record(kind)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> HostSyncCounter:
        for name in self._METHODS:
            self._patch(torch.Tensor, name, name)
        self._patch(torch.Tensor, "to", "to_cpu", _to_cpu)
        self._patch(torch.cuda, "synchronize", "synchronize")
        # torch.tensor(data, device=accelerator) is a blocking host-to-device copy on CUDA
        self._patch(torch, "tensor", "host_to_device", lambda _a, kw: kw.get("device") is not None)
        try:
            from deepspeed.accelerator import get_accelerator
        except ImportError:  # pragma: no cover - DeepSpeed is a dependency
            pass
        else:
            self._patch(get_accelerator(), "synchronize", "synchronize")
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        assert self._mode is not None
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def pause(self) -> None:
        self.active = False

    def resume(self) -> None:
        self.active = True

    def report(self) -> str:
        return "\n".join(f"{n:4d} x {site}" for site, n in self.sites.most_common()) or "none"
