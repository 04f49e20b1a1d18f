"""benchmarks/gpu_check.py, the prepared first-GPU-hour check: its CPU smoke runs every check and
reports each; its collective counter counts what a real process group is handed."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from launch_utils import REPO, run

sys.path.insert(0, str(REPO / "benchmarks"))


def test_collective_counter_counts_bytes_handed_to_a_real_group(tmp_path) -> None:
    from gpu_check import CollectiveBytes

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with CollectiveBytes() as c:
            dist.all_reduce(torch.ones(1000))  # 4000 bytes
            dist.broadcast(torch.ones(10, dtype=torch.bfloat16), src=0)  # 20 bytes
        dist.all_reduce(torch.ones(7))  # after the block: not counted
    finally:
        dist.destroy_process_group()
    assert (c.bytes, c.calls) == (4020, 2)


@pytest.mark.integration
@pytest.mark.slow  # six checks at tiny shapes on CPU (the DP2 one on two gloo ranks): ~3-5 min
def test_gpu_check_cpu_smoke_reports_every_check(tmp_path) -> None:
    out = tmp_path / "check.json"
    proc = run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], timeout=900,
               PYTHONPATH=f"{REPO}:{REPO / 'plugins'}:{REPO / 'benchmarks'}")
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert not [c for c, r in rows.items() if "error" in r], rows
    red = rows["reduce bytes vs micro-batches"]
    assert red["mib_per_step_accum1"] >= 0 and red["verdict"] and "reduce bytes" in proc.stdout
    dp2 = rows["DP2 reduce bytes vs planner"]  # two gloo ranks: the planner's DP term, once per step
    for m in (1, 4, 8):
        assert dp2[f"counted_over_planned_accum{m}"] == pytest.approx(1.0, abs=0.05), dp2
    assert dp2["mib_dp2_accum8"] == pytest.approx(dp2["mib_dp2_accum1"], rel=0.01)
    assert (dp2["zero_stage_accum1"], dp2["zero_stage_accum8"]) == (2, 1)
    assert dp2["verdict"].startswith("counted = planned") and "DP2 reduce bytes" in proc.stdout
    assert rows["non-finite skip"]["weights_unchanged"] is True
    save = rows["async save thread/device"]
    assert save["main"] is False and save["pinned"] is False  # the writer thread; no CUDA: a plain buffer
    assert 0.99 <= save["host_over_planned"] <= 1.1  # the planner's 12 bytes per owned parameter
    assert rows["MFU / busy eager"]["mfu"] > 0 and "skipped" in rows["MFU / busy compiled"]
