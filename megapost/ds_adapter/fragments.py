"""DeepSpeed's per-parameter views of its flat fp32 partitions (ZeRO 1/2 and the bf16 optimizer):
``param._hp_mapping`` (``lp_fragment_address`` (start, numel) of the fragment this rank owns in the
flattened parameter, ``get_hp_fragment(key)`` the fp32 master or an optimizer-state fragment,
``get_lp_grad_fragment`` the reduced gradient), the relinking of those views to the optimizer's
current state tensors, and the public ``safe_set_full_*`` writers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MASTER = "fp32"  # the key of the fp32 master weight among a fragment's tensors


def is_mapped(p: nn.Parameter) -> bool:
    """Held by a DeepSpeed mixed-precision/ZeRO optimizer (fp32 master in its flat partitions)."""
    return hasattr(p, "_hp_mapping")


def has_bf16_grad(p: nn.Parameter) -> bool:
    """DeepSpeed's bf16 optimizer keeps ``p``'s fp32 gradient as a fragment (``_hp_grad``)."""
    return getattr(p, "_hp_grad", None) is not None


def grad_fragment(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's slice of the flat-partitioned gradient (as in DeepSpeed's ``get_full_hp_grad``), or
    None when this rank's partition holds no element of ``param``."""
    mapping = param._hp_mapping
    if mapping is None:
        return None
    grad = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
    address = mapping.lp_fragment_address
    if grad.numel() == param.numel():  # a full accumulation buffer: keep the owned slice
        grad = grad.narrow(0, address.start, address.numel)
    return grad


def reduced_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The (writable) view of ``param``'s reduced gradient this rank's optimizer steps from, on any
    tensor- or data-parallel rank: the bf16 optimizer's or ZeRO 1/2's fragment, else ``param.grad``."""
    if has_bf16_grad(param) or is_mapped(param):
        return grad_fragment(param)
    return param.grad


def local_zero3_grad(param: nn.Parameter) -> torch.Tensor | None:
    """ZeRO-3: this rank's partition of ``param``'s gradient."""
    from deepspeed.utils import safe_get_local_grad

    return safe_get_local_grad(param)


def owned_fragment(p: nn.Parameter, keys: tuple[str, ...]) -> tuple[int, int, dict[str, torch.Tensor]] | None:
    """(start, numel, {key: 1-D view}) of the fragment of a mapped ``p`` this rank owns: ``MASTER``
    the fp32 master, any other key that optimizer-state tensor; None when it owns none of ``p``."""
    mapping = p._hp_mapping
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    values = {k: mapping.get_hp_fragment() if k == MASTER else mapping.get_hp_fragment(k) for k in keys}
    return address.start, address.numel, {k: v.detach().reshape(-1) for k, v in values.items()}


def link_state(optimizer: Any) -> None:
    """(Re)point DeepSpeed's per-parameter fragments at the base optimizer's current state tensors."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def set_full(p: nn.Parameter, fp32: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
    """Write the full fp32 master and optimizer-state tensors of a mapped ``p`` into the fragments."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    safe_set_full_fp32_param(p, fp32)
    for key, value in states.items():
        safe_set_full_optimizer_state(p, value, key)


def fragment_address(p: nn.Parameter) -> tuple[int, int] | None:
    """(start, numel) in the flattened ``p`` of the fragment this rank owns; None when it owns none."""
    mapping = p._hp_mapping
    if mapping is None:
        return None
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel


def write_fragment(p: nn.Parameter, key: str, value: torch.Tensor) -> None:
    """Copy ``value`` (this rank's fragment, 1-D) into the fp32 master (``MASTER``) or the optimizer
    state ``key`` of a mapped ``p``."""
    mapping = p._hp_mapping
    target = mapping.get_hp_fragment() if key == MASTER else mapping.get_hp_fragment(key)
    with torch.no_grad():
        target.copy_(value.reshape(target.shape))


def can_rebuild_weights(optimizer: Any) -> bool:
    """The optimizer rebuilds its low-precision/module weights from its fp32 partitions itself."""
    return hasattr(optimizer, "update_lp_params")


def rebuild_weights(optimizer: Any) -> None:
    """The module's weights from the fp32 partitions, all-gathered (what an optimizer step ends with)."""
    optimizer.update_lp_params()


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrapper (bf16, ZeRO), or ``optimizer`` itself."""
    return getattr(optimizer, "optimizer", optimizer)


def owned_grad(param: nn.Parameter, tp_rank: int, dp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s reduced gradient whose squared norm this rank contributes (or None):
    tensor-parallel shards on every TP rank, replicated parameters on TP rank 0; of those, the bf16
    optimizer's or ZeRO 1/2's fragment, ZeRO-3's partition, or a full ``param.grad`` on DP rank 0."""
    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
        return None
    if has_bf16_grad(param):  # DeepSpeed BF16_Optimizer
        return grad_fragment(param)
    if param.grad is not None:
        return param.grad if dp_rank == 0 else None
    if hasattr(param, "ds_id"):  # ZeRO-3
        return local_zero3_grad(param)
    if is_mapped(param):  # ZeRO 1/2
        return grad_fragment(param)
    return None


def owned_state(optimizer: Any, p: nn.Parameter, dp_rank: int,
                keys: tuple[str, ...]) -> tuple[int, int, dict[str, torch.Tensor]] | None:
    """(start, numel, {kind: 1-D tensor}) this rank owns of ``p`` (flattened): the fp32 master
    (``MASTER``) and the optimizer state tensors ``keys``; a parameter the optimizer keeps whole is owned
    by data-parallel rank 0. None when this rank owns none of it."""
    if is_mapped(p):
        return owned_fragment(p, (MASTER, *keys))
    if dp_rank != 0:
        return None
    values = {MASTER: p.detach()}
    if keys:
        state = base_optimizer(optimizer).state[p]
        values.update({k: state[k] for k in keys if k != MASTER})
    return 0, p.numel(), {k: v.detach().reshape(-1).float() for k, v in values.items()}
