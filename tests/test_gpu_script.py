"""benchmarks/gpu.sh cannot rot: its --dry-run runs the whole suite on CPU with tiny shapes, from a
fresh clone in a fresh venv where megapost is not installed; every case reports (a failing case is a
row), and the JSON is there after every case."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from case_runner import load_resume, run_cases  # noqa: E402

CASES = ["paper-180m eager 2x2", "paper-180m --kernel-fusion none 2x2",
         "head + loss memory, unfused vs chunked", "add + RMSNorm, triton vs torch",
         "RoPE, triton vs torch ops", "SwiGLU gate, triton vs torch ops", "paper-180m --compile 2x2",
         "paper-180m graphs 2x2",
         "collapse_metrics interval 1", "collapse_metrics interval 10", "real command (plugin interval 10)",
         "hf LlamaForCausalLM (peer)", "1.3b-width", "1.3b-width ckpt", "7b-width", "7b-width ckpt",
         "async save (paper-180m shape)", "paper-180m --no-triton-kernels 2x2"]
# and the planner's micro-batch cases, when it differs from 2


def fresh_venv(root: Path) -> dict[str, str]:
    """A venv without megapost: this interpreter's site packages (torch, DeepSpeed, pip) linked in one
    by one, megapost's editable install and dist-info left out. Returns an environment that activates
    it (no PYTHONPATH)."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(base).iterdir():
            if "megapost" not in entry.name.lower() and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CONDA_PREFIX", "PYTHON")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv}/bin:{env['PATH']}", OMP_NUM_THREADS="1")
    probe = subprocess.run([str(venv / "bin/python"), "-c", "import megapost"], env=env, cwd=root,
                           capture_output=True)
    assert probe.returncode != 0, "megapost is importable in the fresh venv"
    return env


@pytest.mark.integration
@pytest.mark.slow  # ~3 min on 2 cores: an editable install and the whole suite at tiny shapes
def test_gpu_sh_dry_run_from_a_fresh_clone_in_a_fresh_venv(tmp_path) -> None:
    if subprocess.run(["git", "-C", str(REPO), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    env, out = fresh_venv(tmp_path), tmp_path / "suite.json"
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", "--dry-run", "--out", str(out), "--inject-failure",
                           "7b-width ckpt"], cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0 and "installing megapost from" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert result["dry_run"] and set(CASES) <= set(rows) and result["running"] is None
    assert "injected" in rows["7b-width ckpt"]["error"] and "7b-width ckpt" in proc.stdout
    assert [c for c, r in rows.items() if "error" in r] == ["7b-width ckpt"]  # the others all ran
    first = rows["paper-180m eager 2x2"]
    assert first["host_syncs"]["counted"] == 0 and first["tokens_per_s"] > 0
    assert len(first["step_times"]) == 2 and first["ops_per_step"] > 100 and first["busy_fraction"] is None
    kernels = first["top_kernels"]
    own = [k["self_ms"] for k in kernels]
    assert own == sorted(own, reverse=True) and any(k["total_ms"] > k["self_ms"] for k in kernels)
    assert rows["paper-180m --kernel-fusion none 2x2"]["auto_over_none"] > 0
    assert rows["paper-180m --no-triton-kernels 2x2"]["triton_over_torch_paths"] > 0
    assert 0 < rows["head + loss memory, unfused vs chunked"]["head_chunked_over_unfused"] < 10
    for case, base in [("add + RMSNorm, triton vs torch", "torch"),
                       ("RoPE, triton vs torch ops", "function"),
                       ("SwiGLU gate, triton vs torch ops", "function")]:
        paths = {r["path"]: r for r in rows[case]["triton_op"]["rows"]}  # triton: in its interpreter
        assert paths[base]["ops_per_call"] > paths["triton"]["ops_per_call"] > 0
    assert rows["collapse_metrics interval 10"]["overhead"] is not None  # the plugin loaded, from the clone
    assert rows["real command (plugin interval 10)"]["real_over_bench"] > 0
    assert rows["hf LlamaForCausalLM (peer)"]["tokens_per_s"] > 0
    save = rows["async save (paper-180m shape)"]  # written in the background, equal to the state at the save
    assert save["async"]["snapshot_exact"] and save["sync"]["snapshot_exact"]
    assert save["lost_over_sync_wall"] >= 0
    assert result["shapes"]["paper-180m"][:6] == [48, 512, 1536, 4, None, 2048]  # the paper: 4 heads
    assert 0 < result["suite_wall_s"] < result["budget_s"]


def test_a_failing_case_is_a_row_and_the_json_is_on_disk_after_every_case(tmp_path) -> None:
    out = str(tmp_path / "r.json")
    seen: list[list[str]] = []

    def on_disk(_rows: list) -> dict:  # what a reader of the file sees while this case runs
        doc = json.loads(Path(out).read_text())
        seen.append([r["case"] for r in doc["rows"]] + [f"running {doc['running']}"])
        return {"v": len(seen)}

    def broken(_rows: list) -> dict:
        raise ValueError("no kernel image")

    doc = run_cases([("a", on_disk), ("b", broken), ("c", on_disk)], out, {"device": "cpu"})
    assert seen == [["running a"], ["a", "b", "running c"]]
    assert [r["case"] for r in doc["rows"]] == ["a", "b", "c"]
    assert "no kernel image" in doc["rows"][1]["error"]
    assert json.loads(Path(out).read_text()) == json.loads(json.dumps(doc)) and not list(tmp_path.glob(".*"))


def test_resume_records_the_case_a_dead_process_was_in_and_runs_the_rest(tmp_path) -> None:
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"device": "cpu", "rows": [{"case": "a", "v": 1}], "running": "b"}))
    assert load_resume(str(out))["rows"][-1]["case"] == "b"
    ran: list[str] = []
    cases = [(n, lambda _r, n=n: ran.append(n) or {}) for n in ("a", "b", "c")]
    doc = run_cases(cases, str(out), {}, resume=True)
    assert ran == ["c"] and [r["case"] for r in doc["rows"]] == ["a", "b", "c"]
    assert "process died" in doc["rows"][1]["error"]


def test_compile_toolchain_check_names_what_is_missing(monkeypatch) -> None:
    from toolchain import compile_toolchain_missing

    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": "/nonexistent/include"})
    line = compile_toolchain_missing()
    assert "CC=/nonexistent/cc" in line and "Python.h" in line and "\n" not in line


def test_budget_stops_starting_cases_that_would_pass_it_and_keeps_the_finished_rows(tmp_path) -> None:
    ran: list[str] = []
    cases = [(n, lambda _r, n=n: ran.append(n) or {}) for n in ("a", "b", "c")]
    estimates = {"a": 1.0, "b": 500.0, "c": 1.0}
    doc = run_cases(cases, str(tmp_path / "r.json"), {}, budget_s=60.0, estimate=estimates.__getitem__)
    assert ran == ["a", "c"]
    rows = {r["case"]: r for r in doc["rows"]}
    assert "budget" in rows["b"]["skipped"] and "case_wall_s" in rows["a"] and doc["elapsed_s"] < 60


def test_each_case_runs_in_its_own_process_and_a_crash_or_timeout_is_a_row() -> None:
    from case_runner import in_fresh_process

    write = ("import json, os, sys; json.dump({'pid': os.getpid()}, "
             "open(sys.argv[sys.argv.index('--row-out') + 1], 'w'))")
    row = in_fresh_process([sys.executable, "-c", write], timeout=60)
    assert row["pid"] != os.getpid()
    assert "without a row" in in_fresh_process([sys.executable, "-c", "import os; os._exit(9)"], 60)["error"]
    assert "timed out" in in_fresh_process([sys.executable, "-c", "import time; time.sleep(30)"], 1)["error"]


def _closure(names: list[str]) -> set[str]:
    """The installed distributions ``names`` need to import: each and its requirements (no extras)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        with contextlib.suppress(PackageNotFoundError):
            reqs = [Requirement(r) for r in distribution(name).requires or []]
            todo += [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def pinned_venv(root: Path) -> dict[str, str]:
    """A venv holding only what gpu.sh installs: torch (a CUDA torch brings its own) and the packages
    of benchmarks/gpu_wheels.txt, each linked in from this interpreter's install; megapost from this
    tree through PYTHONPATH."""
    from importlib.metadata import distribution

    pins = [line.split("==")[0] for line in (REPO / "benchmarks/gpu_wheels.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name in _closure(["torch", *pins]):
        with contextlib.suppress(Exception):  # not installed here: the import below says what is missing
            dist = distribution(name)
            for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
                if not (site / top).exists() and Path(dist.locate_file(top)).exists():
                    (site / top).symlink_to(dist.locate_file(top))
    env = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "PYTHON")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv}/bin:{env['PATH']}", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}:{REPO / 'plugins'}")
    return env


@pytest.mark.integration
def test_hf_peer_case_runs_with_what_gpu_sh_installs(tmp_path) -> None:
    """The suite's HF peer row (transformers' LlamaForCausalLM at the dry run's tiny shape, 2 steps) in a
    venv holding only gpu.sh's install set: the row's dependency is one gpu.sh installs."""
    env, row = pinned_venv(tmp_path), tmp_path / "row.json"
    case = ["--case", "hf LlamaForCausalLM (peer)", "--row-out", str(row), "--out", str(tmp_path / "s.json")]
    proc = subprocess.run([f"{tmp_path}/venv/bin/python", "benchmarks/gpu_suite.py", "--dry-run", *case],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and row.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(row.read_text())
    assert "error" not in result and result["tokens_per_s"] > 0, result
