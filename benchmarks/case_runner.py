"""Run benchmark cases one at a time so that every case reports: a case that raises becomes a row with
its error and the next case runs; the JSON is rewritten atomically after every case (and names the case
in flight, so a process that dies still leaves every finished row, and ``resume`` records the crashed
case as a failed row and goes on with the rest). Shared by gpu_suite.py and gpu_check.py."""

from __future__ import annotations

import gc
import json
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megapost.utils.atomic import atomic_write_text

Case = tuple[str, Callable[[list[dict[str, Any]]], dict[str, Any]]]  # fn(rows so far) -> row


def _free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write(path: str, doc: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(doc, indent=1, default=str))


def load_resume(path: str) -> dict[str, Any] | None:
    """The JSON of an earlier run of the same suite that died mid-case, with the case it died in
    turned into a failed row; None when there is nothing to resume."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        doc = json.load(f)
    if doc.get("running"):
        doc["rows"].append({"case": doc["running"], "error": "the process died in this case (crash, "
                            "OOM kill or abort); the suite restarted after it"})
        doc["running"] = None
    return doc


def run_cases(cases: Sequence[Case], out: str, meta: dict[str, Any], resume: bool = False,
              fail: str | None = None) -> dict[str, Any]:
    """Run ``cases`` in order into ``out`` (``meta`` plus ``rows``); ``fail`` (tests) names a case made
    to raise, to show the suite goes on. With ``resume`` the rows of a JSON a died process left are
    kept and its finished cases are not run again."""
    doc = (load_resume(out) if resume else None) or {**meta, "rows": [], "running": None}
    done = {r["case"] for r in doc["rows"]}
    for name, fn in cases:
        if name in done:
            continue
        doc["running"] = name
        _write(out, doc)
        try:
            if fail is not None and fail == name:
                raise RuntimeError(f"failure injected by --inject-failure {name!r}")
            row = {"case": name, **fn(doc["rows"])}
        except Exception as e:  # noqa: BLE001  a failing case is a row; the suite goes on
            last = traceback.extract_tb(e.__traceback__)[-1]
            row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                          f"({os.path.basename(last.filename)}:{last.lineno})"}
        doc["rows"].append(row)
        doc["running"] = None
        _write(out, doc)
        _free_device()
    return doc


def row_by_case(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The finished (not failed, not skipped) row of case ``name``."""
    return next((r for r in rows if r["case"] == name and "error" not in r and "skipped" not in r), None)
