"""Pickle-free state in a checkpoint: nested Python state (the RNG, the plugins') as JSON with its
tensors stored beside it in safetensors, and the process's RNG state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def encode(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """Nested state -> JSON, tensors moved into ``tensors`` (referenced by key)."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {str(k): encode(v, tensors, f"{key}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return {"__seq__": [encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return obj


def decode(obj: Any, tensors: Any) -> Any:
    """:func:`encode`'s inverse; ``tensors``: a mapping by key (looked up only for tensors)."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        if "__seq__" in obj:
            items = [decode(v, tensors) for v in obj["__seq__"]]
            return tuple(items) if obj["tuple"] else items
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj


def rng_state() -> dict[str, Any]:
    """Python's, torch's, NumPy's (pickle-free) and CUDA's RNG state of this process."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    if isinstance(np_state, dict):
        np_state = (np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
