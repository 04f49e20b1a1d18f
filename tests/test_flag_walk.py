"""Every flag the trainer's parser accepts acts: prepared as a launch with and without it, it changes what
the trainer runs — the resolved configuration's sections (not their copy of every flag), the generated
DeepSpeed config, or a plugin's state built from its flags ("wired") — or it is refused in one line, or it
adds a start-up note. A flag the resolver merely copies is "silent", and none may be."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from megapost.config.arguments import build_parser
from megapost.config.errors import ConfigError
from megapost.config.megatron_flags import CHOICES
from megapost.config.resolved import resolve
from megapost.optim.ds_config import build_ds_config
from megapost.parallel.state import ParallelState
from megapost.plugin_api import plugin_classes
from megapost.train.plugin_services import plugin_contexts
from megapost.train.prepare import prepare

# Values for flags whose type alone does not give a usable one.
VALUES: dict[str, list[str]] = {
    "--data-path": ["other_prefix"], "--split": ["90,9,1"], "--dyt-alpha-init": ["0.5,0.1"],
    "--data-args-path": ["/nonexistent/args.txt"], "--per-split-data-args-path": ["/nonexistent/s.json"],
    "--plugins": ["collapse_metrics"], "--preset": ["paper-180m"],
    "--norm-position": ["pre"],  # without Megatron model flags the default resolves to post
    "--collapse-layers": ["1,2"], "--collapse-guard-remedy": ["warmup"], "--kernel-fusion": ["none"],
}
SKIP = {"-h", "--help"}
# Flags that act only beside another one (a preset to override, a feature to tune): walked with it, on a
# reference run that has it too.
CONTEXT: dict[str, list[str]] = {
    "--no-bf16": ["--preset", "paper-180m"], "--fp32": ["--preset", "paper-180m"],
    "--manual-gc-interval": ["--manual-gc"],
    **{f"--collapse-guard-{k}": ["--collapse-guard", "--collapse-early-warning"]
       for k in ("remedy", "retries", "interval", "on")},
    **{f"--collapse-autopsy-{k}": ["--collapse-autopsy", "2", "--collapse-early-warning"]
       for k in ("after", "hessian-every", "on", "power-iters")},
    "--collapse-early-warning-factor": ["--collapse-early-warning"],
}
# Flags that act only at more ranks (judged there, resolved as on GPUs, where their defaults differ).
WORLD: dict[str, int] = {"--no-overlap-grad-reduce": 2, "--overlap-grad-reduce": 2}
# Flags whose one effect is to accept a launch the base would refuse in another setting, or that the
# launcher sets: not judged here, each covered by the named test.
ACCEPT_ONLY: dict[str, str] = {
    "--allow-tokenizer-mismatch": "test_data_trust.py (data tokenized by another tokenizer)",
    "--override-data": "test_data_trust.py (a resume on other data)",
    "--collapse-guard-law": "test_guard_law.py (the law remedy reads the given fit)",
    "--local_rank": "set by the launcher: the rank's device (every multi-rank test)",
}


def _candidates(action: argparse.Action) -> list[list[str]]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [[o] for o in action.option_strings]
    if action.nargs == 0:
        return [[flag]]
    if flag in VALUES:
        return [[flag, *VALUES[flag]]]
    if action.dest in CHOICES:  # Megatron flags megapost accepts with some values only
        return [[flag, v] for v in (*CHOICES[action.dest][0], "unsupported-value")]
    if action.choices:
        return [[flag, str(c)] for c in action.choices if c != action.default]
    default = action.default if action.default is not argparse.SUPPRESS else None
    if action.type is int:
        return [[flag, str((default or 1) + 1)]]
    if action.type is float:
        return [[flag, repr((default or 0.0) + 0.25)]]
    return [[flag, "/tmp/megapost-flag-walk"]]


WORLD_SIZES = (1, 2, 4)  # a layout flag is judged at the first world size it fits


def _resolved(argv: list[str], worlds: tuple[int, ...] = WORLD_SIZES) -> tuple[dict[str, Any], list[str]]:
    """What the trainer would run: the resolved configuration's sections (not the copy of every flag)
    on a CPU and a GPU rank, the generated DeepSpeed config and the start-up notes, prepared as the
    trainer prepares a launch (at the first world size of ``worlds`` that the flags fit)."""
    error: ConfigError | None = None
    for world in worlds:
        try:
            prep = prepare(argv, world_size=world)
        except ConfigError as e:
            error = error or e
            continue
        out: dict[str, Any] = {"world": world}
        notes = [*prep.args.megatron_notes, *prep.args.start_notes]
        for device in ("cpu", "cuda"):
            config = resolve(prep.args, prep.model, device, prep.plugin_classes)
            sections = config.to_json()
            sections["logging"].pop("megatron_notes")  # notes are judged as notes
            notes += sections["engine"].pop("reduce_notes")
            out[device] = {"resolved": sections, "deepspeed": build_ds_config(config.engine, prep.user_ds)}
        contexts = plugin_contexts(prep.plugin_classes, config, ParallelState())
        out["plugins"] = [_plain(cls(ctx)) for cls, ctx in zip(prep.plugin_classes, contexts, strict=True)]
        return out, notes
    assert error is not None
    raise error


def _plain(value: Any, depth: int = 3) -> Any:
    """A plugin's state as plain data (what its flags were resolved into), its context left out."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v, depth) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _plain(v, depth) for k, v in value.items()}
    if depth == 0 or not hasattr(value, "__dict__"):
        return type(value).__name__
    return {k: _plain(v, depth - 1) for k, v in vars(value).items() if k != "ctx"}


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """The leaf paths where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in set(a) | set(b) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if repr(a) == repr(b) else [path]


def classify(base: list[str]) -> dict[str, tuple[str, list[str]]]:
    """Each flag setting's kind: refused (one-line error), noted (a start-up note), wired (the resolved
    configuration or the DeepSpeed config changes), or silent; with the changed config paths."""
    parser = build_parser(plugin_classes("collapse_metrics"))
    own = {a.dest for a in build_parser()._actions}  # megapost's; the rest are the plugin's
    refs: dict[tuple[str, ...], tuple[dict[str, Any], list[str]]] = {}
    result: dict[str, tuple[str, list[str]]] = {}
    for action in parser._actions:
        if not action.option_strings or set(action.option_strings) & SKIP:
            continue
        if set(action.option_strings) & set(ACCEPT_ONLY):
            continue
        for argv in _candidates(action):
            plugin = [] if action.dest in own else ["--plugins", "collapse_metrics"]
            context = CONTEXT.get(argv[0], []) + plugin
            worlds = (WORLD[argv[0]],) if argv[0] in WORLD else WORLD_SIZES
            changed: list[str] = []
            try:
                values, notes = _resolved([*base, *context, *argv], worlds)
            except (ConfigError, SystemExit):
                kind = "refused"
            else:
                key = (*context, str(values["world"]))
                if key not in refs:  # the reference: the same launch without the flag, at that world size
                    refs[key] = _resolved([*base, *context], (values["world"],))
                ref, ref_notes = refs[key]
                changed = _differences(values, ref)
                if changed:
                    kind = "wired"
                elif notes != ref_notes:
                    kind = "noted"
                else:
                    kind = "silent"
            result[" ".join(argv[:1] + argv[1:2])] = (kind, changed)
    return result


def test_every_flag_acts(tiny_data, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--data-path", str(tiny_data.prefix), "--tokenizer-model", str(tiny_data.tokenizer_model)]
    for split in ("train", "valid", "test"):
        VALUES[f"--{split}-data-path"] = ["1.0", str(tiny_data.prefix)]
    result = classify(base)
    counts = {k: sum(1 for v, _ in result.values() if v == k) for k in ("wired", "noted", "refused",
                                                                         "silent")}
    with capsys.disabled():
        print(f"\nflag walk: {len(result)} flag settings: {counts}")
    silent = sorted(f for f, (kind, _) in result.items() if kind == "silent")
    assert not silent, f"accepted and silently ignored: {silent}"
    assert len(result) > 150
