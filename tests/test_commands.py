"""The console scripts setup.py declares: each installed beside this interpreter, each answers --help
(exit 0), and bad input is one line on stderr; the old ``python tools/<x>.py`` paths still run them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from launch_utils import REPO, child_env

BIN = Path(sys.executable).parent


def console_scripts() -> dict[str, str]:
    """{command: module:function} of setup.py's console_scripts."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    return dict(line.replace(" ", "").split("=", 1) for line in points["console_scripts"])


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)


def test_the_user_commands_are_declared() -> None:
    assert {"megapost-pretrain", "megapost-preprocess", "megapost-train-tokenizer", "megapost-plan",
            "megapost-export-hf", "megapost-sweep"} <= set(console_scripts())


@pytest.mark.integration
@pytest.mark.parametrize("command", sorted(console_scripts()))
@pytest.mark.integration
def test_command_answers_help(command: str) -> None:
    path = BIN / command
    assert path.is_file(), f"{command} is not installed beside {sys.executable}: pip install -e . again"
    proc = _run([str(path), "--help"])
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-2000:]


@pytest.mark.integration
def test_bad_input_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    proc = _run([str(BIN / "megapost-preprocess"), "--input", str(missing), "--output-prefix",
                 str(tmp_path / "o"), "--tokenizer-model", str(tmp_path / "t.model")])
    assert (proc.returncode, proc.stderr) == (2, f"error: input not found: {missing}\n")
    proc = _run([str(BIN / "megapost-export-hf"), "--load", str(tmp_path), "--output", str(tmp_path / "hf")])
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert f"--load {tmp_path}: no 'latest'" in proc.stderr


@pytest.mark.integration
def test_old_tool_paths_run_the_same_commands() -> None:
    for script, usage in (("preprocess_data", "--input PATH_OR_GLOB"), ("train_tokenizer", "--vocab-size"),
                          ("convert_to_hf", "--load LOAD")):
        proc = _run([sys.executable, f"tools/{script}.py", "--help"])
        assert proc.returncode == 0 and usage in proc.stdout, (script, proc.stderr[-1000:])


def test_every_doc_is_indexed() -> None:
    """docs/README.md names every page of docs/."""
    index = (REPO / "docs/README.md").read_text()
    pages = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md"]
    missing = [name for name in pages if f"`{name}`" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


def test_every_tool_and_benchmark_is_indexed() -> None:
    """tools/README.md and benchmarks/README.md name every script of their folder."""
    for folder in ("tools", "benchmarks"):
        index = (REPO / folder / "README.md").read_text()
        scripts = [p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob("*")
                   if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts]
        missing = [s for s in scripts if f"`{s}`" not in index and f"`{Path(s).name}`" not in index]
        assert not missing, f"{folder}/README.md does not list {missing}"
