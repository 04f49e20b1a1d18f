"""Run benchmark cases one at a time so that every case reports: a case that raises becomes a row with
its error and the next case runs; the JSON is rewritten atomically after every case (and names the case
in flight, so a process that dies still leaves every finished row, and ``resume`` records the crashed
case as a failed row and goes on with the rest). Shared by gpu_suite.py and gpu_check.py."""

from __future__ import annotations

import gc
import json
import os
import time
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


def write_json(path: str, doc: dict[str, Any]) -> None:
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


def error_row(e: BaseException) -> dict[str, str]:
    """A failed case's row: the exception's first line and where it was raised."""
    last = traceback.extract_tb(e.__traceback__)[-1]
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                     f"({os.path.basename(last.filename)}:{last.lineno})"}


def run_cases(cases: Sequence[Case], out: str, meta: dict[str, Any], resume: bool = False,
              fail: str | None = None, budget_s: float | None = None,
              estimate: Callable[[str], float] = lambda _name: 0.0) -> dict[str, Any]:
    """Run ``cases`` in order into ``out`` (``meta`` plus ``rows``); ``fail`` (tests) names a case made
    to raise, to show the suite goes on. With ``resume`` the rows of a JSON a died process left are
    kept and its finished cases are not run again. With ``budget_s`` a case is not started when the
    time spent plus its ``estimate`` would pass the budget (its row says so); ``elapsed_s`` is kept."""
    doc = (load_resume(out) if resume else None) or {**meta, "rows": [], "running": None}
    done = {r["case"] for r in doc["rows"]}
    start = time.perf_counter() - doc.get("elapsed_s", 0.0)
    for name, fn in cases:
        if name in done:
            continue
        spent = time.perf_counter() - start
        if budget_s is not None and spent + estimate(name) > budget_s:
            doc["rows"].append({"case": name, "skipped": f"budget: {spent:.0f} s of --budget-s "
                                f"{budget_s:.0f} spent, this case needs ~{estimate(name):.0f} s"})
            continue
        case_start = time.perf_counter()
        doc["running"] = name
        write_json(out, doc)
        try:
            if fail is not None and fail == name:
                raise RuntimeError(f"failure injected by --inject-failure {name!r}")
            row = {"case": name, **fn(doc["rows"])}
        except Exception as e:  # noqa: BLE001  a failing case is a row; the suite goes on
            row = {"case": name, **error_row(e)}
        row["case_wall_s"] = time.perf_counter() - case_start
        doc["rows"].append(row)
        doc["running"] = None
        doc["elapsed_s"] = time.perf_counter() - start
        write_json(out, doc)
        _free_device()
    return doc


def row_by_case(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The finished (not failed, not skipped) row of case ``name``."""
    return next((r for r in rows if r["case"] == name and "error" not in r and "skipped" not in r), None)


def in_fresh_process(argv: list[str], timeout: float) -> dict[str, Any]:
    """The row a case's own interpreter writes (``argv`` + ``--row-out FILE``): a clean allocator, no
    engine of an earlier case alive, a per-case timeout; its output goes to this process's."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="case-") as d:
        path = os.path.join(d, "row.json")
        try:
            proc = subprocess.run([*argv, "--row-out", path], timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s (the budget left)"}
        if not os.path.exists(path):
            return {"error": f"the case's process exited {proc.returncode} without a row (crash, OOM kill)"}
        with open(path) as f:
            return json.load(f)
