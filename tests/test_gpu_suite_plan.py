"""benchmarks/gpu_suite.py's planned schedule (benchmarks/suite_plan.py): every must-show row of issue 48
in a call whose estimates sum to at most --budget-s, printed by --plan and by the dry run, and a nonzero
exit, before any case starts, when a must-show call's sum passes the budget."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_suite  # noqa: E402

MUST_SHOW = {"1": ["paper-180m eager 4x8", "paper-180m eager 16x2", "collapse_metrics interval 1",
                   "collapse_metrics interval 10", "paper-180m --no-triton-kernels 4x8",
                   "real command (plugin interval 10)"],
             "2": ["paper-180m graphs 4x8", "paper-180m graphs 16x2", "hf LlamaForCausalLM (peer)"]}
ROW = re.compile(r"^  part (\S+) +(\d+) s  (.+)$")


def _plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", *argv])
    rc = gpu_suite.main()
    return rc, capsys.readouterr().out


def test_the_must_show_rows_fit_two_calls(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    rc, out = _plan(monkeypatch, capsys, "--plan", "--part", "all")
    rows: dict[str, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows.setdefault(m[1], []).append((m[3], int(m[2])))
    assert rc == 0
    for part, names in MUST_SHOW.items():
        assert [n for n, _ in rows[part]] == names  # in the must-show's order
        total = sum(est for _, est in rows[part])
        assert total <= 300 and f"part {part:5s} {total:5d} s of 300 s: fits" in out


@pytest.mark.parametrize("argv", [["--plan", "--part", "1"], ["--dry-run", "--part", "2"]])
def test_a_call_past_its_budget_fails_before_any_case(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, argv: list[str],
                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_suite, "run_cases", lambda *a, **k: pytest.fail("a case started"))
    rc, out = _plan(monkeypatch, capsys, *argv, "--budget-s", "200", "--out", str(tmp_path / "s.json"))
    assert rc == 1 and "s of 200 s: FAIL: the sum exceeds the budget" in out
