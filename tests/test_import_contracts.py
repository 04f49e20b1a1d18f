"""The import-linter contracts of pyproject.toml: ``make test`` runs lint-imports once on the tree (kept);
here each contract is broken, naming it, by one bad import in a copy of the tree (integration tier: each
case runs lint-imports in a subprocess)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports")
    assert lint is not None, "lint-imports not found: pip install -e '.[dev]' (import-linter)"
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'plugins'}")
    return subprocess.run([lint, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "megapost", root / "megapost", ignore=ignore)
    plugin = Path("plugins", "collapse_metrics")
    shutil.copytree(ROOT / plugin, root / plugin, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


BAD_IMPORTS = [  # (module, bad import, the contract it breaks): one copy of the tree holds them all
    ("megapost/model/norm.py", "import megapost.parallel.state",
     "model imports nothing of megapost but utils"),
    ("plugins/collapse_metrics/state.py", "import megapost.model.config",
     "collapse_metrics imports nothing of megapost but megapost.plugin_api"),
    ("megapost/optim/schedule.py", "import megapost.checkpoint.format",
     "optim never imports checkpoint or train"),
    ("megapost/ds_adapter/fragments.py", "import megapost.utils.atomic",
     "ds_adapter (DeepSpeed private API) imports nothing of megapost"),
    ("megapost/study/hazard.py", "import megapost.optim.schedule",
     "study (torch-free) imports only config.errors and utils"),
]


def broken_sections(stdout: str) -> dict[str, str]:
    """Each broken contract's heading (its last line, if wrapped) -> its report, from lint-imports'
    "Broken contracts" part: a heading is the line above a line of dashes."""
    lines = stdout.split("Broken contracts", 1)[-1].splitlines()[2:]
    dashes = lambda line: bool(line) and set(line) == {"-"}
    heads = [i - 1 for i in range(1, len(lines)) if dashes(lines[i]) and lines[i - 1].strip()
             and not dashes(lines[i - 1])]
    return {lines[h].strip(): "\n".join(lines[h + 1:nxt]) for h, nxt in zip(heads, [*heads[1:], len(lines)],
                                                                            strict=True)}


@pytest.mark.integration
def test_each_bad_import_breaks_its_own_contract(tree_copy: Path) -> None:
    """One lint-imports run on a copy with four bad imports: each named contract is broken by its own."""
    for module, bad_import, _ in BAD_IMPORTS:
        path = tree_copy / module
        path.write_text(path.read_text() + f"\n{bad_import}  # deliberately against the layering\n")
    proc = lint_imports(tree_copy)
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken = broken_sections(proc.stdout)
    for module, bad_import, contract in BAD_IMPORTS:
        assert contract in broken, (contract, sorted(broken), proc.stdout[-3000:])
        importer = module.removesuffix(".py").replace("/", ".").removeprefix("plugins.")
        assert f"{importer} -> {bad_import.split()[-1]}" in broken[contract], (contract, broken[contract])


# ---- DeepSpeed's private API only in megapost.ds_adapter ------------------------------------------------
PRIVATE_DEEPSPEED = re.compile(r"deepspeed\.runtime|_hp_mapping|_hp_grad\b|_lazy_init_hp|fp32_groups_flat|"
                               r"bit16_groups|_take_model_step|\._global_grad_norm|enable_backward_allreduce|"
                               r"\bengine\._[a-z]")


def private_deepspeed_access(root: Path) -> list[str]:
    """``file:line`` of every use of DeepSpeed's private API outside megapost/ds_adapter/."""
    hits = []
    for path in sorted((root / "megapost").rglob("*.py")):
        if "ds_adapter" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_DEEPSPEED.search(line):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_private_deepspeed_api_only_in_the_adapter(tree_copy: Path) -> None:
    assert private_deepspeed_access(ROOT) == []
    path = tree_copy / "megapost" / "checkpoint" / "writer.py"
    original = path.read_text()
    path.write_text(original + "\nfrom deepspeed.runtime.utils import see_memory_usage  # deliberately\n")
    try:
        hits = private_deepspeed_access(tree_copy)
        assert [h.split(":")[0] for h in hits] == ["megapost/checkpoint/writer.py"], hits
    finally:
        path.write_text(original)
