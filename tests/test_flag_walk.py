"""Every flag the trainer's parser accepts acts: parsed with and without it, it changes the resolved
configuration (its own setting, read by the product code — "wired" — or another one — "mapped"), or it
is refused in one line, or it adds a start-up note. None is silent."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megapost.config.arguments import build_parser, parse_args, validate_args
from megapost.config.errors import ConfigError
from megapost.config.megatron_flags import CHOICES
from megapost.plugin_api import plugin_classes

ROOT = Path(__file__).resolve().parent.parent
# Values for flags whose type alone does not give a usable one.
VALUES: dict[str, list[str]] = {
    "--data-path": ["other_prefix"], "--split": ["90,9,1"], "--dyt-alpha-init": ["0.5,0.1"],
    "--data-args-path": ["/nonexistent/args.txt"], "--per-split-data-args-path": ["/nonexistent/s.json"],
    "--plugins": ["collapse_metrics"], "--preset": ["paper-180m"],
    "--norm-position": ["pre"],  # without Megatron model flags the default resolves to post
}
SKIP = {"-h", "--help"}
# Flags that act only beside another one (a preset to override, a feature to tune): walked with it, on a
# reference run that has it too.
CONTEXT: dict[str, list[str]] = {
    "--no-bf16": ["--preset", "paper-180m"], "--fp32": ["--preset", "paper-180m"],
}


def _sources() -> str:
    """The product code, minus the lines that only declare flags."""
    text = []
    for path in [*ROOT.glob("megapost/**/*.py"), *ROOT.glob("plugins/**/*.py")]:
        text += [line for line in path.read_text().splitlines() if "add_argument(" not in line]
    return "\n".join(text)


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


def _resolved(argv: list[str], classes: list[type]) -> tuple[dict, list[str]]:
    """Parsed and, where the flag is valid on one rank, validated as the trainer does."""
    args = parse_args(argv, classes)
    try:
        validate_args(args, 1)
    except ConfigError:
        pass  # e.g. a layout that needs another world size: judged on the parse alone
    notes = [*args.megatron_notes, *getattr(args, "start_notes", [])]
    values = {k: v for k, v in vars(args).items() if k not in ("explicit", "megatron_notes", "start_notes")}
    return values, notes


def classify(base: list[str]) -> dict[str, str]:
    classes = plugin_classes("collapse_metrics")
    parser = build_parser(classes)
    refs: dict[tuple[str, ...], tuple[dict, list[str]]] = {}
    source = _sources()
    result: dict[str, str] = {}
    for action in parser._actions:
        if not action.option_strings or set(action.option_strings) & SKIP:
            continue
        for argv in _candidates(action):
            context = CONTEXT.get(argv[0], [])
            if tuple(context) not in refs:
                refs[tuple(context)] = _resolved([*base, *context], classes)
            ref, ref_notes = refs[tuple(context)]
            try:
                values, notes = _resolved([*base, *context, *argv], classes)
            except (ConfigError, SystemExit):
                kind = "refused"
            else:
                changed = {k for k in set(values) | set(ref) if values.get(k) != ref.get(k)}
                # read by the product: as a flag (args.x) or a typed-config field (config.runtime.x, opt.x)
                read = re.search(rf"\w\.{action.dest}\b|[\"']{action.dest}[\"']", source)
                if notes != ref_notes:
                    kind = "noted"
                elif changed - {action.dest}:
                    kind = "mapped"
                elif action.dest in changed and read:
                    kind = "wired"
                else:
                    kind = "silent"
            result[" ".join(argv[:1] + argv[1:2])] = kind
    return result


def test_every_flag_acts(tiny_data, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--data-path", str(tiny_data.prefix), "--tokenizer-model", str(tiny_data.tokenizer_model)]
    for split in ("train", "valid", "test"):
        VALUES[f"--{split}-data-path"] = ["1.0", str(tiny_data.prefix)]
    result = classify(base)
    counts = {k: sum(1 for v in result.values() if v == k) for k in ("wired", "mapped", "noted", "refused",
                                                                      "silent")}
    with capsys.disabled():
        print(f"\nflag walk: {len(result)} flag settings: {counts}")
    silent = sorted(f for f, kind in result.items() if kind == "silent")
    assert not silent, f"accepted and silently ignored: {silent}"
    assert len(result) > 150
