"""Shard specs (megapost.parallel.shard_spec): each tensor-parallel layer declares how it split its
weight, the checkpoint records that declaration with every piece and places pieces by it — not by
shapes — while checkpoints from before specs (format 2: dim/offset only) still read as recorded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megapost.checkpoint import specs
from megapost.checkpoint.specs import local_spec, piece_split
from megapost.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megapost.parallel.shard_spec import REPLICATED, ShardSpec, declare, spec_of


def test_each_parallel_layer_declares_its_split() -> None:
    # Megatron's table: column-parallel and vocab-parallel split rows (dim 0), row-parallel columns (dim 1)
    assert spec_of(ColumnParallelLinear(nn.Linear(4, 6, bias=False), None).weight) == ShardSpec(0, 1)
    assert spec_of(RowParallelLinear(nn.Linear(4, 6, bias=False), None).weight) == ShardSpec(1, 1)
    assert spec_of(VocabParallelEmbedding(nn.Embedding(8, 4), None).weight) == ShardSpec(0, 1)


def _param(shape: tuple[int, ...], spec: ShardSpec | None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape))
    if spec is not None:
        declare(p, spec.dim, spec.replicas)
    return p


def test_a_declared_split_places_the_piece() -> None:
    # TP 2, rows: rank 1 holds rows 8..15 of 16
    assert local_spec(_param((8, 4), ShardSpec(0)), (16, 4), 1, 2, "w") == (ShardSpec(0), 8)
    # grouped K/V heads, TP 4 over 2 slices (2 replicas each): rank 3 holds slice 1, rows 4..7 of 8
    assert local_spec(_param((4, 4), ShardSpec(0, 2)), (8, 4), 3, 4, "wk") == (ShardSpec(0, 2), 4)
    # columns: rank 2 of 4 holds columns 6..8 of 12
    assert local_spec(_param((4, 3), ShardSpec(1)), (4, 12), 2, 4, "wo") == (ShardSpec(1), 6)


def test_a_declared_split_never_infers_from_shapes(monkeypatch) -> None:
    def no_inference(*_: object) -> None:
        raise AssertionError("inferred from shapes")

    monkeypatch.setattr(specs, "infer_split", no_inference)
    assert local_spec(_param((8, 4), ShardSpec(1)), (8, 8), 1, 2, "w") == (ShardSpec(1), 4)
    with pytest.raises(AssertionError, match="inferred"):  # only an undeclared piece is inferred
        local_spec(_param((8, 4), None), (8, 8), 1, 2, "w")


def test_undeclared_parameters_replicated_or_inferred() -> None:
    assert local_spec(_param((5,), None), (5,), 1, 2, "norm") == (REPLICATED, 0)
    assert local_spec(_param((3, 4), None), (6, 4), 1, 2, "w") == (ShardSpec(0, 1), 3)


def test_a_piece_is_placed_by_its_recorded_spec_else_by_its_recorded_offset() -> None:
    spec = {"shape": [8, 8], "local": [8, 4], "spec": {"dim": 1, "replicas": 1}, "dim": 0, "offset": 0}
    assert piece_split(spec, 1) == (1, 4)  # the spec, not the (here deliberately wrong) dim/offset
    old = {"shape": [8, 8], "local": [8, 4], "dim": 1, "offset": 4}  # format 2: as recorded
    assert piece_split(old, 1) == (1, 4)
