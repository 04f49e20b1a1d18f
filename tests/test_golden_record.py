"""benchmarks/golden/record.py's machine record: a golden recording names the CPU that made it, and a
comparison on another kind of CPU says so in one line (CPU kernels round differently)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _record_module():
    spec = importlib.util.spec_from_file_location("golden_record", REPO / "benchmarks/golden/record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_machine_is_read_from_cpuinfo() -> None:
    now = _record_module().machine()
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "model name" in text:
        first = next(line for line in text.splitlines() if line.startswith("model name"))
        assert now["cpu"] == first.split(":", 1)[1].strip()
    assert set(now) == {"cpu", "simd"}


def test_a_comparison_names_both_cpus_only_when_they_differ(tmp_path) -> None:
    record = _record_module()
    reference = tmp_path / "golden.json"
    reference.write_text("{}")
    assert "missing" in record.machine_note(reference)
    machine_file = tmp_path / "golden.machine.json"
    machine_file.write_text(json.dumps(record.machine()))
    assert record.machine_note(reference) is None
    machine_file.write_text(json.dumps({"cpu": "Some Other CPU", "simd": "avx2"}))
    note = record.machine_note(reference)
    assert note.startswith(f"note: {reference} was recorded on Some Other CPU (avx2); this machine is ")
    assert record.machine()["cpu"] in note and "--base REV" in note and "\n" not in note


def test_the_checked_in_golden_names_its_cpu() -> None:
    recorded = json.loads((REPO / "benchmarks/golden/golden.machine.json").read_text())
    assert set(recorded) == {"cpu", "simd"} and recorded["cpu"]
