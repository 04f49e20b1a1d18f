"""What used to be process globals is owned: a run's interrupt state (``interrupts.Progress``) is the
trainer's instance and its signal handlers are that instance's; the tensor-parallel byte counter is the
``counting_comm`` block's, gone when the block ends; the parallel layout is the instance the build
passes down. Everything in this process (one gloo rank), no subprocess."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

import megapost.parallel.state as state_module
from megapost.parallel import collectives, initialize_parallel
from megapost.parallel.state import ParallelState
from megapost.runtime.interrupts import ExitConditions, Progress


@pytest.fixture
def default_handlers():
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_signal_reaches_the_run_whose_handlers_are_installed(default_handlers) -> None:
    ours, other = Progress(), Progress()
    exits = ExitConditions(0, 0.0, True, ours)  # --exit-signal-handler: ours defers SIGINT/SIGTERM
    assert exits.check(1) is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert (ours.requested, other.requested) == (signal.SIGTERM, 0)
    assert exits.check(2) == "SIGTERM (--exit-signal-handler)"
    other.install()  # a later run's handlers (not deferring): SIGINT interrupts it, ours is left alone
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert other.interrupted and not ours.interrupted and ours.requested == signal.SIGTERM


def test_the_interrupt_line_is_the_runs() -> None:
    progress = Progress(save="/ckpt", run_name=None, state=type("S", (), {"iteration": 7})(),
                        checkpoint_of=lambda save: f"{save}/iter_0000005")
    line = progress.interrupted_line()
    assert line.startswith("interrupted at iteration 7; last complete checkpoint: /ckpt/iter_0000005; ")
    assert Progress().last_checkpoint() == "none (no --save)"


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_count_into_the_open_block_only(one_rank) -> None:
    x = torch.ones(3, 4)  # 48 bytes
    with collectives.counting_comm() as outer:
        collectives.all_reduce(x, None)
        inner_stats = collectives.CommStats()
        with collectives.counting_comm(inner_stats) as inner:
            assert inner is inner_stats and collectives.active_counter() is inner
            collectives.all_reduce(x, None)
            collectives.all_gather(x, 0, None)
            inner.enabled = False
            collectives.all_reduce(x, None)  # switched off: not counted
        assert collectives.active_counter() is outer
    assert collectives.active_counter() is None
    collectives.all_reduce(x, None)  # outside any block: counted nowhere
    assert dict(outer.calls) == {"all_reduce": 1} and dict(outer.bytes) == {"all_reduce": 48}
    assert dict(inner.calls) == {"all_reduce": 1, "all_gather": 1}


def test_the_parallel_layout_is_an_instance_passed_down() -> None:
    first, second = initialize_parallel(1, 1, True), initialize_parallel(1, 1, False)
    assert first is not second and not first.sequence_parallel  # one tensor-parallel rank: a no-op
    assert not [v for v in vars(state_module).values() if isinstance(v, ParallelState)]


def test_the_interrupt_line_before_any_checkpoint_says_the_run_starts_over() -> None:
    progress = Progress(save="/ckpt", run_name=None, state=type("S", (), {"iteration": 3})(),
                        checkpoint_of=lambda save: None)
    line = progress.interrupted_line()
    assert line.startswith("interrupted at iteration 3; last complete checkpoint: none; nothing saved "
                           "(Ctrl-C saves only with --exit-signal-handler); start over with: ")
    assert "resume with" not in line
