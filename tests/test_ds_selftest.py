"""The DeepSpeed adapter's start-up self-test (megapost.ds_adapter.selftest): its checks pass on the
installed DeepSpeed, whose version setup.py pins to the tested range, and a DeepSpeed (or a skip rule)
that no longer catches DeepSpeed's own +inf mark of an invalid norm is refused in one line naming the
version. Every training test runs the full self-test on a real engine (engine.hooks.install)."""

from __future__ import annotations

import re

import deepspeed
from launch_utils import REPO

from megapost.ds_adapter import TESTED, selftest


def test_setup_pins_the_tested_range_and_it_holds_the_installed_version() -> None:
    assert f'"deepspeed{TESTED}"' in (REPO / "setup.py").read_text()
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", TESTED).groups()
    version = tuple(int(x) for x in deepspeed.__version__.split("+")[0].split(".")[:3])
    bounds = [tuple(map(int, b.split("."))) for b in (low, high)]
    assert bounds[0] <= version < bounds[1], deepspeed.__version__


def test_the_checks_pass_on_the_installed_deepspeed() -> None:
    assert selftest._decision() is None
    assert selftest._fused_skip() is None


def test_a_skip_rule_that_misses_deepspeeds_inf_is_one_line_naming_the_version(monkeypatch) -> None:
    monkeypatch.setattr(selftest, "non_finite", lambda norm: norm < 0)  # the rule the issue found
    monkeypatch.setattr(selftest, "_attributes", lambda engine: None)  # no engine in this unit test
    monkeypatch.setattr(selftest, "_fragment_round_trip", lambda engine: None)
    line = selftest.run(None)
    assert line == (f"DeepSpeed {deepspeed.__version__}: megapost's adapter self-test failed (a group norm "
                    "of inf combines to inf, which the skip would not catch); megapost is tested with "
                    f"deepspeed{TESTED}: pip install 'deepspeed{TESTED}'"), line
