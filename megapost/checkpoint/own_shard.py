"""Resume at the layout a tag was saved at: each rank reads only its own shard file.

At the same (TP, PP, DP, ZeRO stage, bf16, SP) layout every rank's fp32 master and optimizer-state
fragments are exactly what it wrote (``checkpoint.sharded``), so it copies them from its own file into
DeepSpeed's flat partitions and rebuilds the low-precision weights with the optimizer's own all-gather
(``update_lp_params``, what a step ends with) — instead of assembling every full parameter from every
data-parallel rank's file. Used only when every local parameter lives in DeepSpeed's partitions (ZeRO
1/2, the bf16 optimizer); ZeRO-0 fp32 keeps its parameters whole on every rank, written once by
data-parallel rank 0, and loads through :class:`megapost.checkpoint.layout_free.ShardIndex`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from megapost.checkpoint import layout_free as lf
from megapost.config.errors import ConfigError
from megapost.ds_adapter import fragments


def load(engine: Any, pstate: Any, tag_dir: str, header: dict[str, Any], params: dict[str, Any],
         keys: list[str], layout: dict[str, Any] | None = None) -> Any:
    """At ``layout`` (this run's) = the tag's, with every local parameter partitioned: copy this rank's
    fragments (fp32 and ``keys``) from its own file only and return its RNG; else None."""
    partitioned = all(lf._is_mapped(p) for p in params.values()) and \
        fragments.can_rebuild_weights(engine.optimizer)
    if not (header.get("format") == 2 and layout is not None and header.get("layout") == layout and params
            and partitioned):
        return None
    path = os.path.join(tag_dir, lf.DIR, lf.shard_file_v2(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank))
    with safe_open(path, framework="pt") as f, torch.no_grad():
        head = json.loads(f.metadata()["megapost"])
        for name, p in params.items():
            address = fragments.fragment_address(p)
            if address is None:
                continue  # none of p in this rank's partition: the all-gather brings it
            saved = head["params"].get(name)
            if saved is None or (saved["start"], saved["numel"]) != address:
                raise ConfigError(f"--load {path}: the fragment of {name} differs from this rank's "
                                  "partition at the same layout; load it at another layout or report this")
            fragments.write_fragment(p, fragments.MASTER, f.get_tensor(f"fp32/{name}"))
            for k in keys:
                fragments.write_fragment(p, k, f.get_tensor(f"{k}/{name}"))
        rng = lf._decode(head["rng"], {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng")})
    fragments.rebuild_weights(engine.optimizer)  # the bf16/module weights, all-gathered
    return rng
