"""The ownership rule of a parameter's reduced gradient and fp32 master (under ZeRO 1/2/3 and DeepSpeed's
bf16 optimizer), read from DeepSpeed's fragments (megapost.ds_adapter.fragments). Plugins get theirs
through the Engine protocol (megapost.train.plugin_binding).

Each rank owns a part of ||grad||^2 so that one sum over all ranks gives the full value:
  * tensor parallelism: shards tagged ``tensor_model_parallel`` count on every TP rank, replicated
    parameters (the RMSNorm gains) only on TP rank 0;
  * ZeRO 1/2 and the bf16 optimizer keep the reduced fp32 gradient as flat partitions: a rank owns the
    fragment of each parameter in its partition (the slice ``safe_get_full_grad`` would contribute to
    its all-reduce), ZeRO-3 its local partition (``safe_get_local_grad``);
  * a full, data-parallel-reduced ``param.grad`` (no ZeRO partitioning) is owned by DP rank 0.
"""

from __future__ import annotations

import torch
from torch import nn

from megapost.ds_adapter import fragments

owned_grad = fragments.owned_grad  # the rule above, where DeepSpeed's fragments are read


def owned_master(param: nn.Parameter, tp_rank: int, dp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s fp32 master weight this rank owns, by the rule of ``owned_grad``: under
    ZeRO 1/2 and the bf16 optimizer its fragment of the flat fp32 partition, else the parameter itself
    (the master under fp32 ZeRO-0) on DP rank 0."""
    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
        return None
    if fragments.is_mapped(param):  # None: this rank's partition holds no element of param
        owned = fragments.owned_fragment(param, (fragments.MASTER,))
        return None if owned is None else owned[2][fragments.MASTER]
    return param.detach() if dp_rank == 0 else None
