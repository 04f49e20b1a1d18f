"""tools/readme_numbers.py (issue 28 item 5; README.md and docs/*.md): a planner example written from
the planner's own --json output passes; the same page with one quoted number edited fails, naming the
line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launch_utils import REPO

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

COMMAND = "python -m megapost.plan --preset paper-180m --gpus 8 --gpu-memory-gb 80"


def _tool(readme) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/readme_numbers.py", "--readme", str(readme)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_planner_numbers_pass_then_an_edited_one_fails(tmp_path) -> None:
    out = subprocess.run([sys.executable, *COMMAND.split()[1:], "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    plan = json.loads(out[out.index("{"):])
    rec = plan["recommended"]
    layout = " ".join(rec["label"].split()[:5])
    paper = layout.rsplit(" mb", 1)[0] + " mb4 "  # the recommended layout at the paper's micro-batch
    mb4 = next(f["peak_gb"] for f in plan["fitting"] if f["label"].startswith(paper))
    line = (f"  8 GPUs:   {layout}  peak {rec['peak_gb']:.1f} GiB   {rec['step_seconds']:.3g} s/step   "
            f"{rec['tokens_per_second'] / 1e6:.3g}M tokens/s   (the paper's mb4: {mb4:.1f} GiB)")
    readme = tmp_path / "README.md"
    readme.write_text(f"text\n\n```\n$ {COMMAND}\n{line}\n```\n")
    good = _tool(readme)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "planner: 6 numbers," in good.stdout and "; 0 drift(s)" in good.stdout, good.stdout
    edited = f"peak {rec['peak_gb'] * 1.05:.1f} GiB"  # 5% off: beyond the 1% tolerance
    readme.write_text(readme.read_text().replace(f"peak {rec['peak_gb']:.1f} GiB", edited))
    bad = _tool(readme)
    print(bad.stdout)
    assert bad.returncode == 1
    assert [ln for ln in bad.stdout.splitlines() if ln.startswith("drift:")] == [
        f"drift: README.md:5: {edited} vs {rec['peak_gb']:.4g}"]


@pytest.mark.slow
def test_readme_planner_numbers_are_what_the_planner_prints() -> None:
    """README.md and every docs page: each quoted planner block and law number is what the code prints."""
    result = subprocess.run([sys.executable, "tools/readme_numbers.py"], cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "planner: 0 numbers" not in result.stdout  # the docs still quote planner blocks
