"""How a tensor-parallel layer split its parameter, declared by the layer (``layers.shard``) and
recorded with every piece a checkpoint writes (as megatron-core's ``ShardedTensor`` does), so a reader
never infers the split from shapes.

A ``ShardSpec``: the dimension split over the TP ranks (None: replicated, every rank holds all of it)
and ``replicas``, the number of consecutive ranks that hold the same slice (grouped K/V heads with
fewer groups than TP ranks). Rank t holds slice t // replicas, of ``tp / replicas`` equal slices. The
packed Q/K/V and W_1/W_3 GEMMs (``megapost.model.fusion``) pack these per-projection shards at compute
time; what is stored and split is each projection's own weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    dim: int | None = None  # None: replicated over TP
    replicas: int = 1

    def offset(self, local_shape: tuple[int, ...], tp_rank: int) -> int:
        """Where TP rank ``tp_rank``'s slice starts along ``dim`` (0 when replicated)."""
        return 0 if self.dim is None else (tp_rank // self.replicas) * local_shape[self.dim]

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "replicas": self.replicas}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardSpec:
        return cls(raw["dim"], int(raw.get("replicas", 1)))


REPLICATED = ShardSpec()


def declare(param: nn.Parameter, dim: int | None, replicas: int = 1) -> None:
    """Record on ``param`` how its layer split it."""
    param.shard_spec = ShardSpec(dim, replicas)


def spec_of(param: nn.Parameter) -> ShardSpec | None:
    """The split ``param``'s layer declared; None when none did (a parameter built outside
    ``megapost.parallel.layers``: the reader then infers it, as for checkpoints before specs)."""
    return getattr(param, "shard_spec", None)
