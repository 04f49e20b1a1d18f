"""No host sync on a step that does not log, save, evaluate or measure (README: "no host sync per
step"): two steps of the real trainer counted by ``HostSyncCounter`` at every layout, fp32 and bf16.

On a CPU rank the accelerator device is the CPU, so DeepSpeed's ``.to(accelerator device)`` of a tensor
already there counts as a copy to the CPU; the sites below are such same-device calls (no-ops on CUDA)
and are the only ones let through."""

from __future__ import annotations

import pytest
from host_sync_audit import ITERATIONS, count_syncs

pytestmark = pytest.mark.integration  # every test here starts processes, ranks or runs

SAME_DEVICE = (
    "to_cpu @ deepspeed/runtime/zero/stage_1_and_2.py",  # get_grad_norm_direct: .to(current_device_name())
    "to_cpu @ deepspeed/runtime/pipe/engine.py",  # _exec_load_micro_batch: .to(self.device) of the
    # batch the trainer already moved to the device (trainer.PluginBatches)
)

LAYOUTS = {
    "1 rank": (1, []),
    "TP2+SP": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "DP2 ZeRO-1": (2, ["--zero-stage", "1"]),
    "DP2 ZeRO-2": (2, ["--zero-stage", "2", "--overlap-grad-reduce"]),
    # bf16: megapost's bucketed reduction overlapped with the last micro-batch's backward
    # (megapost.ds_adapter.overlap); fp32: DeepSpeed's ZeRO-1 overlap_comm
    "DP2 ZeRO-1 overlap": (2, ["--zero-stage", "1", "--overlap-grad-reduce"]),
}


def _syncs(sites: dict[str, int]) -> dict[str, int]:
    return {site: n for site, n in sites.items()
            if not any(site.startswith(ok) and ("get_grad_norm_direct" in site or "load_micro_batch" in site)
                       for ok in SAME_DEVICE)}


FAST = {("1 rank", True), ("DP2 ZeRO-2", False)}  # the CI set; every other case is marked slow
CASES = [pytest.param(layout, bf16, id=f"{layout}-{'bf16' if bf16 else 'fp32'}",
                      marks=() if (layout, bf16) in FAST else pytest.mark.slow)
         for layout in LAYOUTS for bf16 in (False, True)]


@pytest.mark.parametrize("layout, bf16", CASES)
def test_no_host_sync_between_log_steps(tiny_data, layout: str, bf16: bool) -> None:
    world, flags = LAYOUTS[layout]
    ranks = count_syncs(tiny_data, world, ["--global-batch-size", "8", *flags, *(["--bf16"] if bf16 else [])])
    assert [r.pop(ITERATIONS) for r in ranks] == [2] * world  # the counter ran over two loop iterations
    report = {f"rank {r}": _syncs(sites) for r, sites in enumerate(ranks) if _syncs(sites)}
    print(f"{layout} {'bf16' if bf16 else 'fp32'}: {[sum(_syncs(s).values()) for s in ranks]} syncs per rank "
          f"(same-device .to() let through: {[sum(s.values()) - sum(_syncs(s).values()) for s in ranks]})")
    assert not report, f"{layout}: host syncs on non-logging steps: {report}"
