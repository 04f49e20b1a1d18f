"""The collapse law's numbers a README quotes, against the code (tools/readme_numbers.py's law part).

Compared with what the code computes today from the SHIPPED fit (megapost/study/boundary_law_post.json,
read, not refitted: whether that file is the fit of study/results is the fitting tool's own test) and
with what the planner prints:
  * the law line ``lr* = ...`` against megapost/study/boundary_report.py's ``law_lines`` (every
    exponent, its interval);
  * every quoted ``collapse risk: ...`` line (whole or cut with ``...``) against the planner's line for the
    nearest ``python -m megapost.plan`` command above it, at the quoted lr;
  * the prose: ``N runs, M configurations`` (the fit's provenance), ``Leave-one-out ...: a/b held-out
    configurations`` (its validation), ``predicts lr* X [lo, hi], Rx below the paper's stable S``, ``the
    interval spans xW``, ``tokens/step extrapolated Tx`` (law_report.paper_test), ``Warmup 0 -> W raises
    lr* xF at L layers`` (the law's warmup and depth x warmup terms).
Nothing here holds a law number: a refit that rewrites the README from the fit's output passes unchanged.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from megapost.study.boundary_law import ENV, SHIPPED_LAW, Law, load_law
from megapost.study.boundary_report import law_lines, paper_factors, paper_test

REPO = Path(__file__).resolve().parent.parent
REL_TOL = 0.01
NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
Drifts = tuple[list[str], int]


def close(quoted: str, actual: float, unit: float = 1.0) -> bool:
    """``quoted`` x ``unit`` within REL_TOL of ``actual`` or half a unit of its last printed digit (the one
    tolerance of tools/readme_numbers.py)."""
    q = quoted.replace(",", "").lstrip("+")
    mantissa, _, exp = q.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half_digit = 0.5 * 10 ** (int(exp or 0) - decimals) * unit
    return abs(float(q) * unit - actual) <= max(REL_TOL * abs(actual), half_digit)


def compare_text(where: str, quoted: str, actual: str) -> Drifts:
    """Token by token: the words equal, the numbers ``close``; a quote ending in ``...`` is a prefix."""
    cut = quoted.rstrip().endswith("...")
    quoted = quoted.rstrip().removesuffix("...").rstrip() if cut else quoted
    q_words, a_words = NUMBER.split(quoted), NUMBER.split(actual)
    q_nums, a_nums = NUMBER.findall(quoted), NUMBER.findall(actual)
    drifts: list[str] = []
    for i, q in enumerate(q_nums):
        if i >= len(a_nums):
            return [f"{where}: quotes more numbers than the code prints ({q} ...)"], i
        if not close(q, float(a_nums[i].replace(",", ""))):
            drifts.append(f"{where}: {q} vs {a_nums[i]} (in '{' '.join(q_words[i].split()[-3:])} {q}')")
    for i, q in enumerate(q_words):
        a = a_words[i] if i < len(a_words) else ""
        last = cut and i == len(q_words) - 1
        if " ".join(q.split()) != " ".join(a.split()) and not (last and a.strip().startswith(q.strip())):
            drifts.append(f"{where}: text {q.strip()!r} vs {a.strip()!r}")
            break
    return drifts, len(q_nums)


def planner_command(text: str, pos: int) -> list[str] | None:
    """The nearest ``python -m megapost.plan ...`` above ``pos`` (one line, or a backticked span)."""
    start = text.rfind("python -m megapost.plan", 0, pos)
    if start < 0:
        return None
    end = re.compile(r"`|\n\s|\n\n|\n\$|#").search(text, start)
    return text[start:end.start() if end else len(text)].split()


def planner_risk(argv: list[str], lr: str, cache: dict[tuple[str, ...], str]) -> str:
    """The planner's ``collapse risk:`` line for ``argv`` at ``--lr lr``, on the shipped fit."""
    words = list(argv)
    if "--lr" in words:
        words[words.index("--lr") + 1] = lr
    else:
        words += ["--lr", lr]
    key = tuple(words)
    if key not in cache:
        env = {**os.environ, ENV: str(SHIPPED_LAW)}
        proc = subprocess.run([sys.executable, *words[1:]], cwd=REPO, capture_output=True, text=True, env=env)
        found = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("collapse risk:")]
        cache[key] = found[0] if found else f"(no collapse risk line; rc {proc.returncode})"
    return cache[key]


def check_risk_lines(text: str, name: str) -> Drifts:
    drifts, covered, cache = [], 0, {}
    for m in re.finditer(r"^.*?(collapse risk: .*)$", text, re.M):
        where = f"{name}:{text.count(chr(10), 0, m.start()) + 1}"
        lr = re.search(r"^collapse risk: \S+ at lr (\S+) ", m[1])
        argv = planner_command(text, m.start())
        if not lr or not argv:
            drifts.append(f"{where}: a collapse risk line without its lr or a planner command above it")
            continue
        found, n = compare_text(where, m[1], planner_risk(argv, lr[1], cache))
        drifts, covered = drifts + found, covered + n
    return drifts, covered


def check_law_line(text: str, name: str, law: Law) -> Drifts:
    actual = next(ln.removeprefix("law: ") for ln in law_lines(law) if ln.startswith("law: lr* = "))
    drifts, covered = [], 0
    for m in re.finditer(r"`(lr\* = [^`]*)`", text):
        found, n = compare_text(f"{name}:{text.count(chr(10), 0, m.start()) + 1}", m[1], actual)
        drifts, covered = drifts + found, covered + n
    return drifts, covered


def _warmup_gain(law: Law, warmup: float, depth: float) -> float:
    x = {**paper_factors(), "depth": depth}
    return math.exp(law.best.mu_sd({**x, "warmup": warmup})[0] - law.best.mu_sd({**x, "warmup": 0.0})[0])


def _pattern(regex: str) -> re.Pattern[str]:
    """A prose pattern whose spaces match any run of blanks (a quote may wrap onto the next line)."""
    return re.compile(regex.replace(" ", r"\s+"))


def prose_checks(law: Law) -> list[tuple[re.Pattern[str], Callable[[re.Match[str]], list[float]]]]:
    """(pattern, the code's values for its numbers in order) of each prose quote."""
    paper, _ = paper_test(law)
    lo, hi = paper["interval"]
    loo = law.validation.get("leave_one_out", []) if law.validation else []
    prov = law.provenance

    def loo_of(m: re.Match[str]) -> list[float]:
        rows = [r for r in loo if r["factor"] + "s" in (m["f1"], m["f2"])]
        return [sum(r["covered"] for r in rows), sum(r["configs"] for r in rows)]

    return [
        (_pattern(r"(\d[\d,]*) runs, (\d+) configurations"), lambda m: [prov["runs"], prov["configs"]]),
        (_pattern(r"Leave-one-out over (?P<f1>\w+) and (?P<f2>\w+): (\d+)/(\d+) held-out"), loo_of),
        (_pattern(r"predicts lr\* (\S+) \[(\S+), (\S+)\], (\S+)x below the paper's stable (\S+);"),
         lambda m: [paper["lr_star"], lo, hi, float(m[5]) / paper["lr_star"], float(m[5])]),
        (_pattern(r"the interval spans x(\d\S*\d)"), lambda m: [hi / lo]),
        (_pattern(r"tokens/step extrapolated (\d+)x"),
         lambda m: [paper["factors"]["tokens_per_step"] / law.box["tokens_per_step"][1]]),
        (_pattern(r"Warmup 0 -> (\d+) raises lr\* x(\S+) at (\d+) layers"),
         lambda m: [float(m[1]), _warmup_gain(law, float(m[1]), float(m[3])), float(m[3])]),
    ]


def check_prose(text: str, name: str, law: Law) -> Drifts:
    drifts, covered = [], 0
    for pattern, values in prose_checks(law):
        for m in pattern.finditer(" ".join(text.split("\n"))):
            where = f"{name}:{text[:m.start()].count(chr(10)) + 1}"  # joined lines: offsets unchanged
            quoted = [g for k, g in enumerate(m.groups(), 1) if k not in
                      {pattern.groupindex.get("f1"), pattern.groupindex.get("f2")}]
            for q, v in zip(quoted, values(m), strict=True):
                covered += 1
                if not close(q, v):
                    drifts.append(f"{where}: {q} vs {v:.4g} (in '{' '.join(m[0].split())}')")
    return drifts, covered


def check_law(text: str, name: str = "README.md") -> tuple[list[str], list[str]]:
    """Drift lines and the coverage parts (``law line: n numbers``, ...) of ``text``."""
    law, _ = load_law(str(SHIPPED_LAW))
    assert law is not None
    drifts, parts = [], []
    for label, (found, n) in (("law line", check_law_line(text, name, law)),
                              ("law prose", check_prose(text, name, law)),
                              ("planner collapse risk", check_risk_lines(text, name))):
        drifts += found
        parts.append(f"{label}: {n} numbers")
    return drifts, parts
