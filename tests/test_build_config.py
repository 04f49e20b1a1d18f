"""The typed config and the build path's pieces that need no training: ``resolve`` is pure and frozen,
``args.json``'s content round-trips, the gradient reduction is resolved once, ``--optimizer`` builds
Megatron's optimizers or is refused in one line, and the Namespace stops at the composition root.
(Training through ``build`` is what every layout test and pretrain test does.)"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megapost.config.errors import ConfigError
from megapost.config.resolved import resolve
from megapost.metrics.monitor import Monitor
from megapost.optim.ds_config import build_ds_config
from megapost.optim.grad_reduce import configure_grad_reduction, overlap_bucket
from megapost.optim.optimizer import build_optimizer
from megapost.parallel.state import ParallelState
from megapost.train.build import build_plugins
from megapost.train.manual_gc import ManualGC
from megapost.train.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]


def _prepare(data, *flags: str, world_size: int = 1):
    from launch_utils import tiny_model_flags

    return prepare(tiny_model_flags(data, **{"--train-iters": 6}) + list(flags), world_size=world_size)


def test_resolve_is_pure_frozen_and_what_ran(tiny_data) -> None:
    prep = _prepare(tiny_data, "--bf16", "--zero-stage", "0", "--global-batch-size", "8")
    before = copy.deepcopy(vars(prep.args))
    config = resolve(prep.args, prep.model, "cpu")
    assert vars(prep.args) == before  # reads the flags, changes none
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimizer.lr = 1.0  # type: ignore[misc]
    assert config.model is prep.model
    assert config.engine.zero_stage == 1  # --bf16 runs DeepSpeed's ZeRO-1 bf16 optimizer
    assert config.engine.batch.grad_accum_steps == 4 and config.data.train_samples == 6 * 8
    assert config.data.valid_samples == 0  # --eval-interval 0
    written = json.loads(json.dumps(config.to_json(), default=str))
    assert written["model"]["hidden_size"] == 64 and written["engine"]["zero_stage"] == 1
    assert written["optimizer"]["lr"] == pytest.approx(3e-3)
    assert set(written) == {"model", "parallel", "data", "optimizer", "checkpoint", "logging", "runtime",
                            "engine", "plugins"}


@pytest.mark.parametrize("flags, device, stage, overlap", [
    ((), "cpu", 1, False), ((), "cuda", 2, True),  # by default overlapped on GPUs: bf16 then needs ZeRO-2
    (("--overlap-grad-reduce",), "cpu", 2, True), (("--zero-stage", "1"), "cuda", 1, True),
    (("--no-overlap-grad-reduce",), "cuda", 1, False)])
def test_grad_reduction_is_resolved_once(tiny_data, flags, device, stage, overlap) -> None:
    """The ZeRO stage and overlap the engine runs are in the config (its engine section, as args.json
    records it); DeepSpeed's config is generated from them, the Namespace left as parsed."""
    prep = _prepare(tiny_data, "--bf16", *flags, world_size=2)
    config = resolve(prep.args, prep.model, device)
    engine = config.engine
    assert (engine.zero_stage, engine.overlap_grad_reduce) == (stage, overlap)
    assert prep.args.overlap_grad_reduce == {"--overlap-grad-reduce": True,
                                             "--no-overlap-grad-reduce": False}.get(flags[:1] and flags[0])
    ds = build_ds_config(engine, {})
    notes = configure_grad_reduction(ds, engine, torch.nn.Linear(64, 64))
    zero = ds["zero_optimization"]
    # bf16 ZeRO-1 is overlapped by megapost's hooks (megapost.ds_adapter.overlap), ZeRO-2 by DeepSpeed's
    assert zero["stage"] == stage and zero.get("overlap_comm", False) == (overlap and stage == 2)
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert any("gradient reduction overlapped with" in n for n in notes) == overlap
    assert overlap_bucket(ds, engine) == (zero["reduce_bucket_size"] if overlap and stage == 1 else None)
    if "--zero-stage" in flags:  # --bf16 --zero-stage 1: the bf16 optimizer's reduction, overlapped
        assert any("asynchronously" in n and "ZeRO stage 1" in n for n in notes)


def test_grad_reduce_in_bf16_is_noted_without_bf16(tiny_data) -> None:
    """Megatron's script may carry --grad-reduce-in-bf16 into an fp32 run: fp32 gradients, reduced in fp32
    (Megatron-LM's own behaviour for fp32 parameters), said in one start-up note."""
    prep = _prepare(tiny_data, "--grad-reduce-in-bf16")
    engine = resolve(prep.args, prep.model, "cpu").engine
    ds = build_ds_config(engine, {})
    configure_grad_reduction(ds, engine, torch.nn.Linear(4, 4))
    assert not engine.grad_reduce_in_bf16 and ds.get("communication_data_type") != "bf16"
    assert any("without --bf16: fp32 gradients are reduced in fp32" in n for n in engine.reduce_notes)


def test_optimizer_flag_builds_megatron_optimizers(tiny_data) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    prep = _prepare(tiny_data, "--optimizer", "sgd")
    sgd = build_optimizer(model, resolve(prep.args, prep.model, "cpu").optimizer)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9  # Megatron's default
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.1, 0.0]  # no decay on 1-D parameters
    momentum0 = _prepare(tiny_data, "--optimizer", "sgd", "--sgd-momentum", "0")
    zero = build_optimizer(model, resolve(momentum0.args, momentum0.model, "cpu").optimizer)
    assert zero.defaults["momentum"] == 0.0
    adam_prep = _prepare(tiny_data)
    adam = build_optimizer(model, resolve(adam_prep.args, adam_prep.model, "cpu").optimizer)
    assert isinstance(adam, torch.optim.AdamW) and adam.defaults["fused"]


def test_unknown_optimizer_is_refused_in_one_line(tiny_data) -> None:
    with pytest.raises(ConfigError) as err:
        _prepare(tiny_data, "--optimizer", "adamw")
    assert str(err.value) == "error: --optimizer adamw: megapost supports adam (AdamW) or sgd"


# ---- the Namespace stops at the composition root ------------------------------------------------------
BELOW_THE_ROOT = ["megapost/checkpoint", "megapost/optim", "megapost/runtime", "megapost/metrics",
                  "megapost/train", "megapost/plan/__init__.py", "megapost/plugin_api.py",
                  "plugins/collapse_metrics/plugin.py", "plugins/collapse_metrics/guard.py",
                  "plugins/collapse_metrics/autopsy.py"]
THE_ROOT = {  # parse, check, resolve (megapost.config and the planner's own CLI are not below it)
    "megapost/train/prepare.py": "parses the flags and checks them before any process group forms",
    "megapost/train/build.py": "resolves them (megapost.config.resolved) and passes sections on",
    "megapost/runtime/run_dir.py": "--run-name/--runs-dir rewrite --save, --tensorboard-dir and --load "
                                   "before resolve; called from prepare and build only",
}
PARSER_TYPES = {"ArgumentParser", "_ArgumentGroup"}  # a plugin's add_arguments declares its flags


def namespace_leaks(path: Path) -> list[str]:
    """Where ``path`` takes or names the parser's Namespace: ``Namespace`` anywhere, a parameter called
    ``args`` (but a tuple: torch's dispatch arguments), or argparse imported for anything but declaring
    flags."""
    found, parser_uses, imported = [], set(), False
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if name == "Namespace":
            found.append(f"{node.lineno}: Namespace")
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "argparse":
            parser_uses |= {node.attr} & PARSER_TYPES
        if isinstance(node, ast.Import):
            imported |= "argparse" in [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"{node.lineno}: from argparse import")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            found += [f"{node.lineno}: {node.name}(args)" for a in params if a.arg == "args"
                      and not (a.annotation and ast.unparse(a.annotation).startswith("tuple"))]
    if imported and not parser_uses:
        found.append("import argparse (not to declare flags)")
    return found


def test_the_namespace_stops_at_the_composition_root(tmp_path) -> None:
    files = [f for entry in BELOW_THE_ROOT
             for f in ([ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py")))]
    leaks = {f.relative_to(ROOT).as_posix(): namespace_leaks(f) for f in files}
    leaks = {k: v for k, v in leaks.items() if v and k not in THE_ROOT}
    assert not leaks, f"the argparse Namespace below the composition root: {leaks}"
    assert all(namespace_leaks(ROOT / f) for f in THE_ROOT)  # the check sees what the root does
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\ndef f(args: argparse.Namespace) -> None: ...\n")
    assert set(namespace_leaks(bad)) == {"2: Namespace", "2: f(args)",
                                         "import argparse (not to declare flags)"}


def test_plugins_get_their_own_typed_config_and_the_run(tiny_data) -> None:
    """A plugin's flags become its own frozen section (``Config.plugins``, from its ``config_class``); the
    run reaches it typed (``RunInfo``, as resolved), never as the Namespace."""
    prep = _prepare(tiny_data, "--bf16", "--manual-gc", "--manual-gc-interval", "7", "--plugins",
                    "collapse_metrics", "--collapse-interval", "3")
    config = resolve(prep.args, prep.model, "cpu", prep.plugin_classes)
    plugins = build_plugins(prep.plugin_classes, config, ParallelState(), Monitor(None, enabled=False))
    try:
        ctx = plugins[0].ctx
        assert ctx.config is config.plugins["collapse_metrics"] and ctx.config.collapse_interval == 3
        assert plugins[0].interval == 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.config.collapse_interval = 1  # type: ignore[misc]
        assert ctx.run.zero_stage == 1 and ctx.run.bf16 and ctx.run.hidden_size == 64  # as resolved
        assert isinstance(plugins[1], ManualGC) and plugins[1].interval == 7  # --manual-gc's plugin
        assert not any(isinstance(v, argparse.Namespace) for v in vars(ctx).values())
    finally:
        for plugin in plugins:
            plugin.close()


def test_a_plugins_config_class_is_its_own_flags() -> None:
    """The collapse plugin's typed config has one field per flag of its argument group, no other."""
    from collapse_metrics.plugin import CollapseMetricsPlugin

    parser = argparse.ArgumentParser()
    before = {a.dest for a in parser._actions}
    CollapseMetricsPlugin.add_arguments(parser)
    dests = {a.dest for a in parser._actions} - before
    assert {f.name for f in dataclasses.fields(CollapseMetricsPlugin.config_class)} == dests
