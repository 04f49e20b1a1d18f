"""The typed config and the build path's pieces that need no training: ``resolve`` is pure and frozen,
``args.json``'s content round-trips, ``--optimizer`` builds Megatron's optimizers or is refused in one
line. (Training through ``build`` is what every layout test and pretrain test does.)"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from megapost.config.errors import ConfigError
from megapost.config.resolved import resolve
from megapost.engine.optimizer import build_optimizer
from megapost.train.prepare import prepare


def _prepare(data, *flags: str):
    from launch_utils import tiny_model_flags

    return prepare(tiny_model_flags(data, **{"--train-iters": 6}) + list(flags), world_size=1)


def test_resolve_is_pure_frozen_and_what_ran(tiny_data) -> None:
    prep = _prepare(tiny_data, "--bf16", "--zero-stage", "0", "--global-batch-size", "8")
    before = copy.deepcopy(vars(prep.args))
    config = resolve(prep.args, prep.model)
    assert vars(prep.args) == before  # reads the flags, changes none
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimizer.lr = 1.0  # type: ignore[misc]
    assert config.model is prep.model
    assert config.runtime.zero_stage == 1  # --bf16 runs DeepSpeed's ZeRO-1 bf16 optimizer
    assert config.data.grad_accum_steps == 4 and config.data.train_samples == 6 * 8
    assert config.data.valid_samples == 0  # --eval-interval 0
    written = json.loads(json.dumps(config.to_json(), default=str))
    assert written["hidden_size"] == 64 and written["zero_stage"] == 1  # flat: every flag by name
    assert written["resolved"]["optimizer"]["lr"] == pytest.approx(3e-3)
    assert set(written["resolved"]) == {"model", "parallel", "data", "optimizer", "checkpoint", "logging",
                                        "runtime"}


def test_optimizer_flag_builds_megatron_optimizers(tiny_data) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    prep = _prepare(tiny_data, "--optimizer", "sgd")
    sgd = build_optimizer(model, resolve(prep.args, prep.model).optimizer)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9  # Megatron's default
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.1, 0.0]  # no decay on 1-D parameters
    zero = build_optimizer(model, _prepare(tiny_data, "--optimizer", "sgd", "--sgd-momentum", "0").args)
    assert zero.defaults["momentum"] == 0.0
    adam = build_optimizer(model, _prepare(tiny_data).args)
    assert isinstance(adam, torch.optim.AdamW) and adam.defaults["fused"]


def test_unknown_optimizer_is_refused_in_one_line(tiny_data) -> None:
    with pytest.raises(ConfigError) as err:
        _prepare(tiny_data, "--optimizer", "adamw")
    assert str(err.value) == "error: --optimizer adamw: megapost supports adam (AdamW) or sgd"
