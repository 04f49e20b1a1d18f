"""Every third-party package that the product, plugin, tools, benchmarks or tests import is declared in
what the README's install brings (setup.py's install_requires plus the extras `make install` names),
directly or as a requirement of a declared package. A new `import scipy` with no extra fails here in
seconds, not on a fresh machine (.ci/fresh_venv is the slow proof of the same)."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("megapost", "plugins", "tools", "benchmarks", "tests")
OPTIONAL = ("ImportError", "ModuleNotFoundError", "Exception")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_extras() -> list[str]:
    """The extras of `make install`'s editable install, e.g. -e ".[dev,hf]"."""
    match = re.search(r'-e "\.\[([^\]]*)\]"', (REPO / "Makefile").read_text())
    assert match, "Makefile's install no longer reads -e \".[extras]\""
    return [e.strip() for e in match.group(1).split(",")]


def declared_distributions() -> set[str]:
    """install_requires + the installed extras, closed over their own (non-extra) requirements."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    reqs = list(ast.literal_eval(kw["install_requires"]))
    extras = ast.literal_eval(kw["extras_require"])
    for extra in _installed_extras():
        reqs += extras[extra]
    todo, seen = [_norm(Requirement(r).name) for r in reqs], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_norm(Requirement(r).name) for r in needs if "extra ==" not in r]
    return seen


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `try: ... except ImportError` (or ModuleNotFoundError, Exception): runs without it."""
    while (node := parents.get(node)) is not None:
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(isinstance(t, ast.Name) and t.id in OPTIONAL for t in types):
                    return True
    return False


def _imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, top-level module name) for each absolute import in tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node, node.module.split(".")[0]))
    return out


def imported_top_names(roots: list[Path]) -> dict[str, str]:
    """{top-level module name: first file importing it} for required imports under roots. A module a
    file imports once under an ImportError guard is optional in that whole file (its later lazy
    imports run only when the guarded one succeeded)."""
    found: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
            imports = _imports(tree)
            optional = {name for node, name in imports if _optional(node, parents)}
            for _, name in imports:
                if name not in optional:
                    found.setdefault(name, str(path))
    return found


def undeclared(roots: list[Path], declared: set[str]) -> list[str]:
    """'module (distribution) in file' for each imported third-party module no declared package brings."""
    local = {p.stem for r in roots for p in r.rglob("*.py")} | {p.name for r in roots for p in r.rglob("*")
                                                                  if p.is_dir()}
    local |= {"megapost", "collapse_metrics"}
    dists = metadata.packages_distributions()
    out = []
    for module, where in sorted(imported_top_names(roots).items()):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        owners = {_norm(d) for d in dists.get(module, [])}
        if not owners & declared:
            out.append(f"{module} ({', '.join(sorted(owners)) or 'not installed'}) in {where}")
    return out


def test_every_import_is_declared_by_the_readme_install() -> None:
    assert undeclared([REPO / r for r in ROOTS], declared_distributions()) == []


def test_an_undeclared_import_is_named(tmp_path: Path) -> None:
    (tmp_path / "uses.py").write_text("import numpy\nfrom packaging import version\n"
                                      "try:\n    import apex\nexcept ImportError:\n    apex = None\n")
    assert undeclared([tmp_path], {"numpy"}) == [f"packaging (packaging) in {tmp_path / 'uses.py'}"]
