"""``megapost.pretrain`` with a fault injected: the harness side of ``megapost.utils.faults``.

    python tests/fault_pretrain.py --fail-rank RANK:ITERATION [megapost flags]
    deepspeed --num_gpus N tests/fault_pretrain.py --fail-rank RANK:ITERATION [megapost flags]

Global rank RANK raises a ``RuntimeError`` just before it runs ITERATION (1-based): a job whose rank
dies must fail as a whole, within --distributed-timeout-minutes, instead of hanging."""

from __future__ import annotations

import sys

from megapost.pretrain import main
from megapost.utils.faults import FaultInjector


class FailRank(FaultInjector):
    def __init__(self, rank: int, iteration: int) -> None:
        self.rank, self.iteration = rank, iteration

    def before_step(self, rank: int, iteration: int) -> None:
        if (rank, iteration) == (self.rank, self.iteration):
            raise RuntimeError(f"injected fault: rank {rank} fails at iteration {iteration} on purpose")


def split_argv(argv: list[str]) -> tuple[FailRank, list[str]]:
    """(the fault of ``--fail-rank RANK:ITERATION``, the other flags)."""
    at = argv.index("--fail-rank")
    rank, iteration = (int(x) for x in argv[at + 1].split(":"))
    return FailRank(rank, iteration), argv[:at] + argv[at + 2:]


if __name__ == "__main__":
    fault, flags = split_argv(sys.argv[1:])
    main(flags, faults=fault)
