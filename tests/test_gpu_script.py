"""benchmarks/gpu.sh cannot rot: its --dry-run runs the whole suite on CPU with tiny shapes."""

from __future__ import annotations

import json

import pytest
from launch_utils import run


@pytest.mark.slow  # ~1-2 min on 2 cores
def test_gpu_sh_dry_run(tmp_path) -> None:
    out = tmp_path / "suite.json"
    proc = run(["bash", "benchmarks/gpu.sh", "--dry-run", "--out", str(out)], timeout=900)
    result = json.loads(out.read_text())
    cases = [r["case"] for r in result["rows"]]
    assert result["dry_run"] and len(cases) == 8 and "megapost/bare" in proc.stdout
    first = result["rows"][0]
    assert first["host_syncs"]["counted"] == 0 and first["top_kernels"] and first["tokens_per_s"] > 0
    assert {"1.3b-width ckpt", "7b-width", "collapse_metrics interval 10"} <= set(cases)
    save = result["async_save"]  # written in the background while steps ran, equal to the state at the save
    assert save["async"]["snapshot_exact"] and save["sync"]["snapshot_exact"]
    assert save["lost_over_sync_wall"] >= 0
