"""Old checkpoints still load: ``tests/data/old_checkpoint`` was written at main 7ef976c (before shard
specs were recorded; tests/data/make_old_checkpoint.py) at TP=2 ZeRO-1. Its TP split is read from what
it recorded then (dim, offset per piece); a resume at TP=1 continues the uninterrupted TP=2 run's
losses."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from launch_utils import pretrain, read_scalars
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
OLD = HERE / "data" / "old_checkpoint"
TAG = OLD / "iter_0000002" / "layout_free"

# The Megatron split of each weight (independent of megapost's code): column-parallel rows (dim 0),
# row-parallel columns (dim 1), norms replicated.
SPLIT = {"attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1, "mlp.w1": 0,
         "mlp.w3": 0, "mlp.w2": 1, "attention_norm": None, "mlp_norm": None}
TOP = {"embedding.word_embeddings.weight": 0, "head.lm_head.weight": 0, "head.final_norm.weight": None}


def _expected_dim(name: str) -> int | None:
    if name in TOP:
        return TOP[name]
    return SPLIT[name.split(".", 2)[2].rsplit(".", 1)[0]]


def _pieces(kind: str, name: str) -> torch.Tensor:
    """The full tensor from the two TP files, concatenated along the table's dim (rank 0 first)."""
    parts = []
    for tp in (0, 1):
        with safe_open(str(TAG / f"shard-tp{tp:02d}-pp00-dp00.safetensors"), framework="pt") as f:
            head = json.loads(f.metadata()["megapost"])["params"][name]
            parts.append(f.get_tensor(f"{kind}/{name}").reshape(head["local"]))
    dim = _expected_dim(name)
    return parts[0] if dim is None else torch.cat(parts, dim)


def test_old_checkpoint_index_reads_recorded_splits() -> None:
    from megapost.checkpoint.reader import ShardIndex

    index = ShardIndex(str(OLD / "iter_0000002"))
    assert len(index.shapes) == 2 + 2 * len(SPLIT)  # Post-Norm: no final norm
    for name in index.shapes:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(index.read(kind, name), _pieces(kind, name)), (kind, name)


def _maker():
    spec = importlib.util.spec_from_file_location("maker", OLD.parent / "make_old_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_old_checkpoint_resumes_at_another_tp(tmp_path) -> None:
    maker = _maker()
    prefix, tokenizer = maker.corpus(tmp_path, OLD / "tokenizer.model")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    out = pretrain(maker.flags(prefix, tokenizer, **{"--train-iters": maker.TOTAL, "--load": ckpt,
                                                     "--tensorboard-dir": tmp_path / "tb"}), timeout=600)
    assert f"resumed from {ckpt} at iteration {maker.SAVED_AT}" in out.stdout
    losses = read_scalars(tmp_path / "tb", "train/lm_loss")
    expected = {int(k): v for k, v in json.loads((OLD / "losses.json").read_text()).items()}
    assert sorted(losses) == [3, 4]
    for step in (3, 4):  # TP=1 against the TP=2 run: rounding only
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step
