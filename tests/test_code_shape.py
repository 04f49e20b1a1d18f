"""House rule: no file over 400 lines and no function over 80 lines outside tests/ (``ast``, so
docstrings and decorators count). ``KNOWN`` lists the offenders that remain, each with its reason; a
new offender fails, and so does a listed one that got fixed (delete it from the list)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("megapost", "plugins", "tools", "benchmarks", "setup.py")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80
KNOWN: set[str] = set()  # none left


def offenders(root: Path = ROOT) -> dict[str, int]:
    """``{"path" or "path::function": lines}`` over every Python file of ``SOURCES``."""
    found: dict[str, int] = {}
    for source in SOURCES:
        base = root / source
        for path in sorted([base] if base.is_file() else base.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text(encoding="utf-8")
            if len(text.splitlines()) > MAX_FILE_LINES:
                found[rel] = len(text.splitlines())
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                        found[f"{rel}::{node.name}"] = node.end_lineno - start + 1
    return found


def test_no_long_files_or_functions() -> None:
    found = offenders()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per function: {new}"
    fixed = KNOWN - set(found)
    assert not fixed, f"no longer over the limit, delete from KNOWN: {sorted(fixed)}"


def test_the_checker_counts_lines(tmp_path: Path) -> None:
    pkg = tmp_path / "megapost"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (pkg / "long.py").write_text(f"@staticmethod\ndef long():\n{body}\n\ndef short():\n    pass\n")
    (pkg / "big.py").write_text("x = 1\n" * 401)
    assert offenders(tmp_path) == {"megapost/long.py::long": 82, "megapost/big.py": 401}
