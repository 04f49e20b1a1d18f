"""The checkpoint package needs nothing but the Engine protocol: a save and a resume of a second,
non-DeepSpeed Engine (tests/fake_engine.py: torch AdamW on a plain model) round-trip its weights,
Adam state, schedule and counters exactly; synchronously and through the AsyncSaver's background
writer (unit tests: one process, no process group)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from fake_engine import FakeEngine

from megapost.checkpoint import resume
from megapost.checkpoint.folder import CheckpointFolder
from megapost.checkpoint.layout import RunLayout
from megapost.checkpoint.saver import AsyncSaver
from megapost.engine import Engine
from megapost.model import ModelConfig
from megapost.parallel.state import ParallelState

CFG = ModelConfig(vocab_size=64, num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                  seq_length=8, norm_position="pre")


def _config(save: str, async_save: bool = False) -> SimpleNamespace:
    """The sections of a resolved Config the checkpoint reads."""
    checkpoint = SimpleNamespace(save=save, load=save, ckpt_step=None, finetune=False, no_load_optim=False,
                                 no_load_rng=False, trust_checkpoint=False, ckpt_format="megapost",
                                 async_save=async_save, save_retain=0, save_retain_every=0, save_interval=1)
    parallel = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               data_parallel_size=1, sequence_parallel=False)
    data = SimpleNamespace(sources=SimpleNamespace(prefixes=[]), tokenizer_model=None)
    return SimpleNamespace(checkpoint=checkpoint, parallel=parallel, model=CFG, data=data,
                           engine=SimpleNamespace(zero_stage=0), runtime=SimpleNamespace(bf16=False))


def _live(engine: FakeEngine) -> dict[str, torch.Tensor]:
    """Every weight and Adam tensor, cloned (what a resume must restore)."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"w/{name}"] = p.detach().clone()
        for k, v in engine.optimizer.state[p].items():
            out[f"{k}/{name}"] = v.detach().clone()
    return out


def test_the_fake_is_an_engine() -> None:
    assert isinstance(FakeEngine(CFG), Engine)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_resume_of_a_second_engine_is_exact(tmp_path, async_save) -> None:
    saved = FakeEngine(CFG, seed=0)
    saved.train_steps(3)
    expected, counters, schedule = _live(saved), saved.counters(), saved.scheduler_state()
    config, pstate = _config(str(tmp_path), async_save), ParallelState()
    saver = AsyncSaver()
    random.seed(11)
    tag = saver.save(saved, config, 3, 12, {"plugin": {"x": torch.arange(3)}}, pstate)
    saver.wait_pending()
    assert CheckpointFolder(str(tmp_path)).latest_name() == tag == "iter_0000003"
    draw = random.random()

    loaded = FakeEngine(CFG, seed=1)  # other weights, no optimizer state yet
    loaded.train_steps(1, seed=5)
    random.seed(0)
    it, consumed, plugins = resume.load(loaded, config.checkpoint, RunLayout.of(config), pstate)
    assert (it, consumed) == (3, 12) and torch.equal(plugins["plugin"]["x"], torch.arange(3))
    assert random.random() == draw  # the saved RNG state came back
    got = _live(loaded)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert loaded.counters() == counters and loaded.scheduler_state() == schedule
    assert loaded.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
