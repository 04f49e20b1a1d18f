"""The ownership rule of a parameter's reduced gradient (under ZeRO 1/2/3 and DeepSpeed's
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

from megapost.ds_adapter import fragments

owned_grad = fragments.owned_grad  # the rule above, where DeepSpeed's fragments are read
