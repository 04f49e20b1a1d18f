"""tools/readme_numbers.py's collapse-law part (tools/readme_law.py, issue 28 item 5): quotes written from
the shipped fit pass; the same quotes with one number edited fail, naming the line; the planner's
collapse-risk line is rerun and compared. Nothing here holds a law number: a refit passes unchanged."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from launch_utils import REPO

sys.path.insert(0, str(REPO / "tools"))
from readme_law import check_law  # noqa: E402

from megapost.study.boundary_law import SHIPPED_LAW, load_law  # noqa: E402
from megapost.study.boundary_report import law_lines, paper_test  # noqa: E402


def _tool(readme) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/readme_numbers.py", "--readme", str(readme)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)


LAW_PAGE = "docs/scaling_study.md"  # where the law's numbers are quoted (tools/readme_numbers.py checks it)


def _drifts(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("drift:")]


def _law_quotes() -> str:
    """The README's law paragraph, its numbers printed from the shipped fit as the README rounds them."""
    law, _ = load_law(str(SHIPPED_LAW))
    line = next(ln.removeprefix("law: ") for ln in law_lines(law) if ln.startswith("law: lr* = "))
    paper, _ = paper_test(law)
    lo, hi = paper["interval"]
    loo = law.validation["leave_one_out"]
    covered, configs = sum(r["covered"] for r in loo), sum(r["configs"] for r in loo)
    tokens = paper["factors"]["tokens_per_step"] / law.box["tokens_per_step"][1]
    x = {**paper["factors"], "depth": 4.0}
    gain = math.exp(law.best.mu_sd({**x, "warmup": 2000.0})[0] - law.best.mu_sd({**x, "warmup": 0.0})[0])
    prov = law.provenance
    return (f"Shipped fit: {prov['runs']} runs, {prov['configs']} configurations:\n  `{line}`\n"
            f"Warmup 0 -> 2000\n  raises lr* x{gain:.2g} at 4 layers. Leave-one-out over widths and depths: "
            f"{covered}/{configs} held-out configurations\ncovered. It predicts lr* {paper['lr_star']:.2g} "
            f"[{lo:.2g}, {hi:.2g}], {6e-4 / paper['lr_star']:.2g}x below the paper's stable 6e-4; the "
            f"interval spans x{hi / lo:.2g} (tokens/step extrapolated {tokens:.0f}x).\n")


def test_law_quotes_pass_then_an_edited_one_fails() -> None:
    text = _law_quotes()
    drifts, parts = check_law(text)
    assert not drifts, drifts
    assert int(parts[0].split()[2]) >= 20 and parts[1] == "law prose: 14 numbers", parts
    exponent = re.search(r"depth\^\((\S+) ", text)[1]  # the depth exponent, edited by 0.2
    edited = f"{float(exponent) + 0.2:+.2f}"
    drifts, _ = check_law(text.replace(f"depth^({exponent} ", f"depth^({edited} ", 1))
    assert len(drifts) == 1 and drifts[0].startswith(f"README.md:2: {edited} vs {exponent}"), drifts
    coverage = re.search(r"(\d+)/(\d+) held-out", text)
    drifts, _ = check_law(text.replace(coverage[0], f"{int(coverage[1]) + 1}/{coverage[2]} held-out"))
    assert len(drifts) == 1 and drifts[0].startswith(f"README.md:4: {int(coverage[1]) + 1} vs "), drifts


@pytest.mark.integration
@pytest.mark.slow
def test_readme_collapse_risk_line_is_what_the_planner_prints(tmp_path) -> None:
    """The law page's own command and (cut) risk line: passes; its lr* edited by 10% fails."""
    text = (REPO / LAW_PAGE).read_text()
    risk = re.search(r"^.*collapse risk: .*$", text, re.M)
    command = text[:risk.start()].rstrip("\n").rsplit("\n", 1)[1]
    assert "python -m megapost.plan" in command
    readme = tmp_path / "README.md"
    readme.write_text(f"```bash\n{command}\n{risk[0]}\n```\n")
    good = _tool(readme)
    assert good.returncode == 0 and not _drifts(good.stdout), good.stdout + good.stderr
    lr_star = re.search(r"predicted lr\* (\S+)", risk[0])[1]
    edited = f"{float(lr_star) * 1.1:.3g}"
    readme.write_text(readme.read_text().replace(f"predicted lr* {lr_star}", f"predicted lr* {edited}"))
    bad = _tool(readme)
    assert bad.returncode == 1 and len(_drifts(bad.stdout)) == 1, bad.stdout
    assert _drifts(bad.stdout)[0].startswith(f"drift: README.md:3: {edited} vs {lr_star}"), bad.stdout


def test_the_readme_quotes_every_law_number_the_checker_reads() -> None:
    # a reworded sentence would silently drop out of the check: every prose quote must be found on the
    # page that keeps the law's numbers (moved from the README with the rest of the reference)
    from readme_law import prose_checks

    law, _ = load_law(str(SHIPPED_LAW))
    text = " ".join((REPO / LAW_PAGE).read_text().split("\n"))
    missing = [p.pattern for p, _ in prose_checks(law) if not p.search(text)]
    assert not missing, f"{LAW_PAGE} no longer quotes: {missing}"
