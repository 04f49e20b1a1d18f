"""Check that the numbers README.md and docs/*.md quote from a command are what the command prints today.

    python tools/readme_numbers.py                 # the planner examples and the law (seconds)
    python tools/readme_numbers.py --slow          # also the main job's validation losses (~3-10 min)
    python tools/readme_numbers.py --readme X.md   # only this file

Covered:
  * every planner example block: a fenced block whose ``$ python -m megapost.plan ...`` lines are rerun
    (``{a,b,c}`` in a flag's value: one run per value, in order) and whose result lines
    (``N GPUs:  <layout>  peak X GiB  S s/step  T tokens/s  (F of C ...)``, optionally
    ``(the paper's mbK: Y GiB)``) are compared with the planner's ``--json`` recommendation;
  * the collapse law (tools/readme_law.py): the law line ``lr* = ...``, its prose numbers (runs,
    configurations, leave-one-out coverage, the paper-180m lr* and interval, the warmup gain) against the
    SHIPPED fit megapost/study/boundary_law_post.json (read, not refitted), and every quoted
    ``collapse risk: ...`` line against the planner's line for the command above it (same tolerance);
  * ``--slow``: in README.md and docs/collapse_study.md (MAIN_PAGES), the main job's ``validation loss
    a / b / c / d at steps i / j / k / l`` (Post-Norm, ``bash examples/pretrain_postnorm.sh``, run once)
    against its ``validation at iteration N | lm loss X`` lines, its ``COLLAPSED at step N`` and the
    gradient ratio quoted after it (``..., gradient ratio X``, or ``< X``: a bound) against the one the
    alarm line prints.
Tolerance: a quoted number matches when it is within 1% of the rerun's value or within half a unit of
its last printed digit (README rounding), whichever is wider; layouts and counts must be equal; losses
within 0.02. Exit 1 with one line per drift (or per line it cannot read), else a summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from readme_law import check_law
from readme_law import close as _close

REPO = Path(__file__).resolve().parent.parent
LOSS_TOL = 0.02
SUFFIX = {"": 1.0, "k": 1e3, "M": 1e6, "B": 1e9}
RESULT = re.compile(
    r"^\s*(?P<gpus>\d+) GPUs:\s+(?P<layout>TP\S+ PP\d+ DP\d+\s+ZeRO-\d mb\d+)\s+peak (?P<peak>[\d.]+) GiB\s+"
    r"(?P<step>[\d.]+) s/step\s+(?P<tps>[\d.]+)(?P<tps_unit>[kMB]?) tokens/s\s+\((?P<rest>.*)\)\s*$")
FIT = re.compile(r"^(?P<fit>\d+) of (?P<cand>\d+)")
PAPER_MB = re.compile(r"the paper's mb(?P<mb>\d+): (?P<peak>[\d.]+) GiB")


@dataclass
class Check:
    where: str  # README line number and the quoted text
    quoted: str
    actual: float | str


def planner_blocks(text: str) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """(line number, command, [(line number, result line)]) of each ``$ python -m megapost.plan``."""
    blocks, lines, current = [], text.splitlines(), None
    for number, line in enumerate(lines, 1):
        if line.startswith("$ python -m megapost.plan"):
            current = (number, line[2:].split("#", 1)[0].strip(), [])
            blocks.append(current)
        elif line.startswith(("$", "```")):
            current = None
        elif current is not None and line.strip():
            current[2].append((number, line))
    return blocks


def expand(command: str) -> list[list[str]]:
    """``--gpus {8,64}`` -> one argv per value."""
    words = command.split()
    choices = [w[1:-1].split(",") if w.startswith("{") and w.endswith("}") else [w] for w in words]
    return [list(combo) for combo in itertools.product(*choices)]


def plan_json(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *argv[1:], "--json"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(argv)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def _short(label: str) -> str:
    """``TP1 PP1 DP8 ZeRO-2 mb16 ga2 -`` -> ``TP1 PP1 DP8 ZeRO-2 mb16`` (what the README quotes)."""
    return " ".join(label.split()[:5])


def check_result(number: int, line: str, plan: dict, name: str = "README.md") -> tuple[list[str], int]:
    """Drift lines of one README result line against the rerun's JSON; and how many numbers it covers."""
    m = RESULT.match(line)
    if not m:
        return [f"{name}:{number}: cannot read this planner line: {line.strip()}"], 0
    rec, where = plan["recommended"], f"{name}:{number}"
    checks: list[tuple[bool, str]] = [
        (m["gpus"] == str(plan["cluster"]["gpus"]), f"{m['gpus']} GPUs vs {plan['cluster']['gpus']}"),
        (" ".join(m["layout"].split()) == _short(rec["label"]), f"layout {m['layout']!r} vs "
         f"{_short(rec['label'])!r}"),
        (_close(m["peak"], rec["peak_gb"]), f"peak {m['peak']} GiB vs {rec['peak_gb']:.4g}"),
        (_close(m["step"], rec["step_seconds"]), f"{m['step']} s/step vs {rec['step_seconds']:.4g}"),
        (_close(m["tps"], rec["tokens_per_second"], SUFFIX[m["tps_unit"]]),
         f"{m['tps']}{m['tps_unit']} tokens/s vs {rec['tokens_per_second']:.4g}"),
    ]
    fit = FIT.match(m["rest"])
    if fit:
        fitting = len(plan["fitting"])
        checks += [(int(fit["fit"]) == fitting, f"{fit['fit']} layouts fit vs {fitting}"),
                   (int(fit["cand"]) == plan["candidates"], f"of {fit['cand']} vs {plan['candidates']}")]
    paper = PAPER_MB.search(m["rest"])
    if paper:
        want = _short(rec["label"]).rsplit(" mb", 1)[0] + f" mb{paper['mb']}"
        same = [f["peak_gb"] for f in plan["fitting"] if _short(f["label"]) == want]
        other = f"{same[0]:.4g}" if same else "no such layout"
        checks.append((bool(same) and _close(paper["peak"], same[0]),
                       f"mb{paper['mb']} peak {paper['peak']} GiB vs {other}"))
    return [f"{where}: {what}" for ok, what in checks if not ok], len(checks)


def check_planner(text: str, name: str = "README.md") -> tuple[list[str], int]:
    drifts, covered = [], 0
    for number, command, results in planner_blocks(text):
        runs = expand(command)
        if len(runs) != len(results):
            drifts.append(f"{name}:{number}: {len(runs)} runs but {len(results)} result lines")
            continue
        for argv, (line_no, line) in zip(runs, results, strict=True):
            found, n = check_result(line_no, line, plan_json(argv), name)
            drifts += found
            covered += n
    return drifts, covered


SLASH = r"\s+/\s+"
MAIN_LOSSES = re.compile(rf"validation\s+loss\s+((?:[\d.]+{SLASH})+[\d.]+)\s+at\s+steps\s+"
                         rf"((?:\d+{SLASH})+\d+)")
MAIN_COLLAPSE = re.compile(r"`\[collapse\] COLLAPSED at step (\d+):`"
                           r"(?:\s+t_sim\(X\^H\)\s+[\d.]+,[\w/\s-]*gradient\s+ratio\s+(<\s*|~)?([\d.]+e-?\d+))?")
VALIDATION = re.compile(r"validation at iteration (\d+) \| lm loss ([\d.]+)")
PRINTED_COLLAPSE = re.compile(r"COLLAPSED at step (\d+): .*?gradient ratio ([\d.]+e[-+]?\d+)")
MAIN_PAGES = ("README.md", "docs/collapse_study.md")  # the pages that quote the main job's run


def main_job_output() -> str | list[str]:
    """The main job's stdout (one process), or its one drift line when it fails."""
    proc = subprocess.run(["bash", "examples/pretrain_postnorm.sh"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        return [f"examples/pretrain_postnorm.sh failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"]
    return proc.stdout


def check_main_job(text: str, stdout: str, name: str = "README.md") -> tuple[list[str], int]:
    """``--slow``: a page's quotes of the main job -- validation losses, the alarm step and the alarm's
    gradient ratio -- against the job's ``stdout``."""
    losses, collapse = MAIN_LOSSES.search(text), MAIN_COLLAPSE.search(text)
    if not losses:
        return [f"{name}: no 'validation loss a / b / ... at steps i / j / ...' quote of the main job"], 0
    ran = {int(i): float(v) for i, v in VALIDATION.findall(stdout)}
    drifts = []
    pairs = list(zip(re.split(SLASH, losses[2]), re.split(SLASH, losses[1]), strict=True))
    for step, quoted in pairs:
        got = ran.get(int(step))
        if got is None or abs(got - float(quoted)) > LOSS_TOL:
            drifts.append(f"{name}: main job validation loss at step {step}: {quoted} vs {got}")
    printed = PRINTED_COLLAPSE.search(stdout)
    if collapse and (not printed or printed[1] != collapse[1]):
        seen = printed[1] if printed else "none"
        drifts.append(f"{name}: main job collapse at step {collapse[1]} vs {seen}")
    if collapse and collapse[3] and printed and not _ratio_ok(collapse[2], collapse[3], float(printed[2])):
        drifts.append(f"{name}: main job gradient ratio at the alarm {collapse[2] or ''}{collapse[3]} vs "
                      f"{printed[2]}")
    return drifts, len(pairs) + bool(collapse) + bool(collapse and collapse[3])


def _ratio_ok(kind: str | None, quoted: str, printed: float) -> bool:
    """``< X``: a bound (the collapsed ratio is rounding noise, a few x from run to run); else ``close``."""
    return printed < float(quoted) if kind and kind.startswith("<") else _close(quoted, printed)


def _name(path: Path) -> str:
    return path.name if path.parent != REPO / "docs" else f"docs/{path.name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", action="append", default=None,
                   help="a file to check (repeatable; default: README.md and docs/*.md)")
    p.add_argument("--slow", action="store_true", help="also rerun the main job (~3-10 min on 2 cores)")
    a = p.parse_args(argv)
    files = [Path(f) for f in a.readme] if a.readme else [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
    drifts, counts = [], {"planner": 0}
    for path in files:
        text, name = path.read_text(), _name(path)
        found, n = check_planner(text, name)
        drifts, counts["planner"] = drifts + found, counts["planner"] + n
        law_drifts, law_parts = check_law(text, name)
        drifts += law_drifts
        for part in law_parts:
            label, n_law = part.rsplit(": ", 1)
            counts[label] = counts.get(label, 0) + int(n_law.split()[0])
    pages = [path for path in files if _name(path) in MAIN_PAGES] if a.slow else []
    stdout = main_job_output() if pages else ""
    if isinstance(stdout, list):
        drifts, pages = drifts + stdout, []
    counts.update({"main job": 0} if pages else {})
    for path in pages:
        more, n = check_main_job(path.read_text(), stdout, _name(path))
        drifts, counts["main job"] = drifts + more, counts["main job"] + n
    for line in drifts:
        print(f"drift: {line}")
    parts = [f"{label}: {n} numbers" for label, n in counts.items()]
    print(f"readme numbers: {', '.join(parts)} checked in {len(files)} file(s); {len(drifts)} drift(s) "
          f"beyond tolerance (1% or the last printed digit; losses {LOSS_TOL})")
    return 1 if drifts else 0


if __name__ == "__main__":
    raise SystemExit(main())
