"""Megatron-LM flags accepted with a start-up note: --wandb-project / --wandb-exp-name / --wandb-save-dir
(logged to Weights & Biases when wandb is importable, a stand-in module here: wandb is not a dependency, else
a one-line note) and --transformer-impl transformer_engine (megapost's own layers run)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from megapost.config.arguments import parse_args
from megapost.metrics.monitor import Monitor, wandb_settings

BASE = ["--data-path", "x", "--tokenizer-model", "x"]
FLAGS = ["--wandb-project", "proj", "--wandb-exp-name", "run1"]


class FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", dict(data), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.init = lambda **kw: (calls.append(("init", kw)), FakeRun(calls))[1]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_without_wandb_one_line_note(monkeypatch) -> None:
    monkeypatch.setattr("megapost.config.logging_flags.wandb_installed", lambda: False)
    notes = parse_args(BASE + FLAGS).megatron_notes
    said = [n for n in notes if "wandb" in n]
    assert said == ["--wandb-project proj: wandb is not installed, nothing is logged to Weights & Biases "
                    "(pip install wandb to log there)"]


def test_with_wandb_scalars_logged(fake_wandb, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = parse_args(BASE + FLAGS + ["--wandb-save-dir", str(tmp_path / "wb")])
    said = "scalars also logged to Weights & Biases (WANDB_MODE=offline)"
    assert any(said in n for n in args.megatron_notes)
    monitor = Monitor(None, enabled=True, wandb=wandb_settings(args))
    monitor.scalars("train", {"loss": 2.5, "lr": 1e-3}, step=3, tokens=96)
    monitor.close()
    assert fake_wandb == [("init", {"project": "proj", "name": "run1", "dir": str(tmp_path / "wb")}),
                          ("log", {"train/loss": 2.5, "train/lr": 1e-3}, 3), ("finish",)]
    assert (tmp_path / "wb").is_dir()


def test_not_logged_off_the_logging_rank_or_without_project(fake_wandb) -> None:
    off_rank = Monitor(None, enabled=False, wandb={"project": "p", "name": None, "dir": None})
    off_rank.scalars("t", {"a": 1}, 1, 1)
    assert wandb_settings(parse_args(BASE)) is None
    assert fake_wandb == []


def test_transformer_engine_noted_as_megapost_layers() -> None:
    """--transformer-impl transformer_engine (Megatron's default, so commonly typed): accepted with one note
    saying megapost's own layers run, never listed as 'with Megatron's meaning'."""
    notes = parse_args(BASE + ["--transformer-impl", "transformer_engine"]).megatron_notes
    said = [n for n in notes if "transformer-impl" in n]
    assert said == ["--transformer-impl transformer_engine (megapost's own torch layers run, not Transformer "
                    "Engine's (Megatron's default is transformer_engine))"]
