"""The import-linter contracts of pyproject.toml (run by ``make test``): kept by the tree as it is, and
broken, naming the contract, by one bad import in a copy of it."""

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


def test_contracts_kept() -> None:
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " broken" in proc.stdout and "0 broken" in proc.stdout


@pytest.mark.parametrize(("module", "bad_import", "contract"), [
    ("megapost/model/norm.py", "import megapost.parallel.state",
     "model imports nothing of megapost but utils"),
    ("plugins/collapse_metrics/state.py", "import megapost.model.config",
     "collapse_metrics imports nothing of megapost but megapost.plugin_api"),
    ("megapost/engine/schedule.py", "import megapost.checkpoint.io",
     "engine never imports checkpoint or train"),
    ("megapost/ds_adapter/fragments.py", "import megapost.utils.atomic",
     "ds_adapter (DeepSpeed private API) imports nothing of megapost"),
    ("megapost/study/hazard.py", "import megapost.engine.schedule",
     "study (torch-free) imports only config.errors and utils"),
])
def test_a_bad_import_breaks_its_contract(tree_copy: Path, module: str, bad_import: str,
                                          contract: str) -> None:
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + f"\n{bad_import}  # deliberately against the layering\n")
    try:
        proc = lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and bad_import.split()[-1] in broken, proc.stdout[-3000:]


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
    path = tree_copy / "megapost" / "checkpoint" / "sharded.py"
    original = path.read_text()
    path.write_text(original + "\nfrom deepspeed.runtime.utils import see_memory_usage  # deliberately\n")
    try:
        hits = private_deepspeed_access(tree_copy)
        assert [h.split(":")[0] for h in hits] == ["megapost/checkpoint/sharded.py"], hits
    finally:
        path.write_text(original)
