"""Count the aten ops a piece of code dispatches (a ``TorchDispatchMode``): a host-cost proxy for a
launch-bound step, since on a GPU nearly every non-view op is one kernel launch.

    with AtenOpCounter() as ops:
        step()
    ops.compute    # ops that touch data (kernels on a GPU)
    ops.by_name    # Counter of "aten.mm", "aten.add_", ... (compute ops only)

View and metadata ops (``view``, ``t``, ``transpose``, ``slice``, ``detach``, ``empty`` ...) launch no
kernel; they are counted apart in ``metadata``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# ops that allocate or re-describe memory without reading it (no kernel on a GPU)
_METADATA = frozenset({
    "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_unsafe_view", "_reshape_alias", "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type",
    "_local_scalar_dense", "result_type", "promote_types", "_record_function_enter_new",
    "_record_function_exit",
})


def is_metadata(func: Any) -> bool:
    """True for ops that launch no kernel: views and the allocation/metadata ops in ``_METADATA``."""
    return bool(getattr(func, "is_view", False)) or func.overloadpacket.__name__ in _METADATA


class _Mode(TorchDispatchMode):
    def __init__(self, counter: AtenOpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.counter.active:
            name = f"{getattr(func, 'namespace', 'aten')}.{func.overloadpacket.__name__}"
            (self.counter.metadata if is_metadata(func) else self.counter.by_name)[name] += 1
        return func(*args, **(kwargs or {}))


class AtenOpCounter:
    """Context manager counting every aten op dispatched inside it (forward, autograd's backward and
    gradient hooks included); ``pause()`` / ``resume()`` exclude a stretch."""

    def __init__(self) -> None:
        self.by_name: Counter[str] = Counter()
        self.metadata: Counter[str] = Counter()
        self.active = False
        self._mode: _Mode | None = None

    @property
    def compute(self) -> int:
        """Ops that read or write tensor data (kernel launches on a GPU)."""
        return sum(self.by_name.values())

    @property
    def total(self) -> int:
        return self.compute + sum(self.metadata.values())

    def pause(self) -> None:
        self.active = False

    def resume(self) -> None:
        self.active = True

    def __enter__(self) -> AtenOpCounter:
        self._mode = _Mode(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None


def count_ops(fn: Any, *args: Any, **kwargs: Any) -> AtenOpCounter:
    """Run ``fn(*args, **kwargs)`` under a fresh counter and return the counter."""
    with AtenOpCounter() as counter:
        fn(*args, **kwargs)
    return counter


def diff(a: Counter[str], b: Counter[str]) -> Counter[str]:
    """``a - b`` per op, negatives kept (Counter's ``-`` drops them)."""
    return Counter({k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys() if a.get(k, 0) != b.get(k, 0)})
