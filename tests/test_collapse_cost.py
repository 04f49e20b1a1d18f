"""What collapse_metrics costs the training step, counted (the timing is benchmarks/collapse_step_cost.py):
a quiet step dispatches exactly the aten ops of a run without the plugin, and a measured step makes no
host read (its values are reduced on the device and read back at the next iteration)."""

from __future__ import annotations

import argparse
import sys

import pytest
from launch_utils import REPO

pytestmark = pytest.mark.integration  # builds trainers (DeepSpeed engines) in this process

sys.path.insert(0, str(REPO / "benchmarks"))

SHAPE = argparse.Namespace(layers=2, hidden=32, seq=16, micro=2, accum=2, vocab=128)


def trainer(plugin: bool, interval: int = 2):
    from bench_common import build_trainer
    from collapse_metrics.plugin import CollapseMetricsPlugin

    flags = ["--plugins", "collapse_metrics", "--collapse-interval", str(interval)] if plugin else []
    return build_trainer(SHAPE, ["--bf16", *flags], (CollapseMetricsPlugin,) if plugin else ())[0]


def quiet_ops(plugin: bool) -> dict[str, int]:
    from megapost.utils.op_count import AtenOpCounter

    t = trainer(plugin)
    try:
        for step in (1, 2):  # step 2 is measured under the plugin, step 3 is quiet
            t.train_step(step)
            t.host.after_iteration(step)
        with AtenOpCounter() as count:
            t.train_step(3)
        return {**count.by_name, **count.metadata}
    finally:
        t.close()


def test_a_quiet_step_dispatches_the_ops_of_a_run_without_the_plugin() -> None:
    from megapost.runtime.distributed import process_group_scope

    with process_group_scope():
        without, with_plugin = quiet_ops(False), quiet_ops(True)
    assert sum(without.values()) > 100
    assert with_plugin == without


@pytest.mark.parametrize("guard", [False, True], ids=["deferred", "guard"])
def test_a_measured_step_reads_nothing_back_until_the_next_iteration(guard) -> None:
    from megapost.metrics.host_syncs import HostSyncCounter
    from megapost.runtime.distributed import process_group_scope

    with process_group_scope():
        t = trainer(True, interval=1)
        plugin = t.plugins[0]
        plugin.defer = not guard  # what --collapse-guard selects (it acts on the step's own values)
        try:
            t.train_step(1)
            t.host.after_iteration(1)
            with HostSyncCounter() as syncs:
                t.train_step(2)
            # the label counts read the host batch (CPU tensors on every device): not a device read
            device_reads = {s: n for s, n in syncs.sites.items() if "collapse_metrics/frequency.py" not in s}
            assert guard or not device_reads, syncs.report()  # the guard reads the step at its end
            assert [r.step for r in plugin.read_backs] == ([] if guard else [1, 2])  # step N: read at N + 1
            assert plugin._last.get("step") == (2 if guard else None)
            t.host.after_iteration(2)
            assert plugin._last.get("step") == (2 if guard else 1)
            t.train_step(3)
            t.host.after_iteration(3)
            assert plugin._last.get("step") == (3 if guard else 2)
            assert plugin.last["step"] == 3  # reading ``last`` reads what is pending
        finally:
            t.close()
