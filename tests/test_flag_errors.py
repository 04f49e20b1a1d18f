"""Every flag error of a launch is reported together, one line each (issue 28 item 2): unknown flags,
values argparse refuses, Megatron refusals, layout arithmetic and a backend this machine lacks."""

from __future__ import annotations

import pytest
import torch

from megapost.config.errors import ConfigError
from megapost.train.prepare import prepare


def _errors(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        prepare(argv, world_size=1)
    return str(caught.value.code).splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is valid where CUDA is")
def test_three_flag_problems_in_one_pass(tiny_data, capsys) -> None:
    base = ["--data-path", str(tiny_data.prefix), "--tokenizer-model", str(tiny_data.tokenizer_model)]
    lines = _errors([*base, "--log-param-norm", "--num-layers", "four", "--distributed-backend", "nccl"])
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(lines) == 3, lines
    assert all(line.startswith("error: ") for line in lines)
    assert any(line.startswith("error: --log-param-norm: unknown flag (nearest: --log-params-norm)")
               for line in lines)
    assert "error: --num-layers: invalid int value: 'four'" in lines
    assert any(line.startswith("error: --distributed-backend nccl: no CUDA device") for line in lines)


def test_checks_after_parsing_report_together(tiny_data) -> None:
    """Megatron refusals, counts and batch arithmetic: each failing check one line, beside parse errors."""
    base = ["--data-path", str(tiny_data.prefix), "--tokenizer-model", str(tiny_data.tokenizer_model)]
    lines = _errors([*base, "--fp16", "--hidden-dropout", "0.1", "--eval-iters", "-1",
                     "--micro-batch-size", "3", "--seed", "x", "--bogus", "1"])
    assert len(lines) == 6, lines
    for start in ("error: --seed: invalid int value", "error: --bogus: unknown flag", "error: --fp16:",
                  "error: --hidden-dropout 0.1:", "error: --eval-iters -1: must be",
                  "error: --global-batch-size 16 is not divisible by --micro-batch-size 3"):
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
