"""Defaults of the example launch scripts (examples/*.sh): the embedded corpus and a config that trains
in minutes. Above ``megapost.pretrain`` (it calls its ``main``); nothing in megapost imports it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path


def example_argv(norm: str, repo: Path, user_argv: Sequence[str]) -> list[str]:
    """The example's flags (embedded data, tiny CPU preset, a run directory under runs/, collapse
    metrics) followed by the user's, which win (argparse keeps the last value of a repeated flag)."""
    from megapost.data.default_corpus import prepare_default_data

    data_dir = Path(os.environ.get("MEGAPOST_DATA_DIR", repo / "data"))
    user = [a for a in user_argv if not a.startswith("--local_rank")]
    typed = {a.split("=", 1)[0] for a in user}
    out = Path(os.environ.get("MEGAPOST_RUN_DIR", repo / "runs"))  # each run: a directory of its own
    if ("--data-path" in typed and "--tokenizer-model" in typed) or _resumes_with_data(out, user):
        data_flags: list[str] = []
    else:
        prefix, tokenizer = prepare_default_data(data_dir)  # idempotent, locked across ranks
        data_flags = ["--data-path", str(prefix), "--tokenizer-model", str(tokenizer)]
    argv = ["--preset", "tiny-cpu", "--norm-position", norm, *data_flags, "--runs-dir", str(out)]
    if importlib.util.find_spec("collapse_metrics.plugin") is not None:
        argv += ["--plugins", "collapse_metrics", "--collapse-interval", "10"]
    return argv + user


def _resumes_with_data(runs: Path, user: Sequence[str]) -> bool:
    """``--run-name N`` of a run that recorded its data: the resume reuses it (config/launches.py)."""
    from megapost.config.launches import read_launches

    if "--run-name" not in user or user.index("--run-name") + 1 >= len(user):
        return False
    run = runs / user[user.index("--run-name") + 1]
    return any(read_launches(str(run / sub)) for sub in ("checkpoints", "tensorboard"))


def run_example(norm: str, script: str, user_argv: Sequence[str]) -> None:
    from megapost.data import DataError
    from megapost.pretrain import main
    from megapost.runtime.interrupts import run_guarded

    repo = Path(script).resolve().parent.parent
    try:  # signals, launcher death and a busy port are handled before the corpus build
        argv = run_guarded(lambda: example_argv(norm, repo, user_argv))
    except DataError as e:  # e.g. offline on the first run: one line naming the file to place
        from megapost.runtime.launcher_report import record_for_launcher

        record_for_launcher(f"error: {e}")
        raise SystemExit(f"error: {e}") from None
    main(argv)
