"""--collapse-guard-remedy law: the re-warm peak comes from the collapse law at the run's own factors; a
remedy that cannot change the run (warmup*F without a warmup) is refused in one line."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from collapse_helpers import collapse_config, run_info
from collapse_metrics.guard import Guard, check_guard_args
from launch_utils import read_scalars
from scipy.stats import norm
from test_collapse_guard import _guard, _records, _run, _split_at_rollback

from megapost.config.errors import ConfigError
from megapost.model import ModelConfig
from megapost.study.boundary_law import FACTORS, Branch, Form, Law, run_factors, save_law
from megapost.train import plugin_services

SIGMA = 0.2
COV = 1e-4  # diagonal


def _law_file(tmp_path, lr_star: float, placement: str = "post"):
    """lr* = lr_star at every shape (width/depth terms with zero coefficients, small covariance)."""
    box = {f: [1.0, 1e6] for f in FACTORS}
    law = Law(Branch(Form(("width", "depth")), [math.log(lr_star), 0.0, 0.0],
                     [[COV if i == j else 0.0 for j in range(3)] for i in range(3)], 0.0), SIGMA, box, {},
              placement=placement)
    path = tmp_path / "law.json"
    save_law(path, law)
    return path


@pytest.mark.integration
@pytest.mark.slow
def test_the_law_remedy_rewarms_to_the_predicted_safe_peak(tiny_data, tmp_path):
    """12 x 32 at lr 0.1 without warmup collapses; with a law whose lr* is 0.01 the rollback re-warms to
    the lr whose P(collapse) is 0.05: 0.01 exp(Phi^-1(0.05) sqrt(sigma^2 + z'Cz)), z = (1, log 32, log 12)."""
    out = tmp_path / "run"
    proc = _run(tiny_data, out, check=False, **_guard("law"), **{"--log-interval": 1,
                "--collapse-guard-law": str(_law_file(tmp_path, 0.01))})
    log = proc.stdout + proc.stderr
    sd = math.sqrt(COV * (1 + math.log(32) ** 2 + math.log(12) ** 2))
    safe = 0.01 * math.exp(norm.ppf(0.05) * math.hypot(SIGMA, sd))
    guard, before, after = _split_at_rollback(_records(out / "collapse_metrics.jsonl"))
    assert guard["lr"] == pytest.approx(safe, rel=1e-6), log[-3000:]
    assert f"remedy law: peak lr {safe:.3g}, warmup 0, lr re-warmed from x0.1 over 50 steps (the law's " \
           "P(collapse) = 0.05 peak here: lr* 0.01" in log
    back = guard["to_step"]
    lrs = read_scalars(out, "train/lr")
    for step in sorted(after):  # the constant schedule (min lr = lr), peak now `safe`, ramped from x0.1
        assert lrs[step] == pytest.approx(safe * (0.1 + 0.9 * min(1.0, (step - back - 1) / 50)), rel=1e-5)
    assert after[back + 2]["loss"] != before[back + 2]["loss"]


MODEL = ModelConfig(vocab_size=256, num_layers=12, hidden_size=32, ffn_hidden_size=96, num_attention_heads=4,
                    seq_length=32, init_variance="paper")


def _guard_inputs(lr_warmup_iters: int = 0, **kw) -> tuple:
    """(the plugin's config, the run, the law service) of a guarded run of MODEL."""
    guarded = {"collapse_guard": True, "collapse_guard_interval": 2, "collapse_guard_retries": 1,
               "collapse_guard_remedy": "law"}
    flags = dataclasses.replace(collapse_config(), **{**guarded, **kw})
    run = run_info(MODEL, train_iters=12, lr=0.1, lr_warmup_iters=lr_warmup_iters)
    factors = run_factors(SimpleNamespace(lr_warmup_iters=lr_warmup_iters, global_batch_size=4, seq_length=32,
                                          train_iters=12, init_variance="paper"), MODEL)
    return flags, run, plugin_services.Law(factors)


def test_the_law_remedy_reads_the_runs_factors(tmp_path):
    """Guard's safe peak: the law at this run's width and depth (lr* = 0.01 exp(-0.1 log d - 0.2 log L)
    here), P(collapse) 0.05: by hand with scipy's normal quantile."""
    zero = [[0.0] * 3 for _ in range(3)]
    law = Law(Branch(Form(("width", "depth")), [math.log(0.01), -0.1, -0.2], zero, 0.0),
              SIGMA, {f: [1.0, 1e6] for f in FACTORS}, {})
    save_law(tmp_path / "l.json", law)
    guard = Guard(*_guard_inputs(collapse_guard_law=str(tmp_path / "l.json")))
    star = 0.01 * 32 ** -0.1 * 12 ** -0.2
    assert guard.safe_lr == pytest.approx(star * math.exp(norm.ppf(0.05) * SIGMA), rel=1e-6)
    assert f"lr* {star:.3g}" in guard.law_note


def test_a_remedy_that_cannot_change_the_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--collapse-guard-remedy warmup\*2: stretches --lr-warmup-iters, "
                       "which is 0 here, so it cannot change the run; use rewarm or law"):
        check_guard_args(*_guard_inputs(collapse_guard_remedy="warmup*2"))
    check_guard_args(*_guard_inputs(collapse_guard_remedy="warmup*2", lr_warmup_iters=10))  # acts: accepted
    with pytest.raises(ConfigError, match="was fitted for --norm-position pre, not post"):
        check_guard_args(*_guard_inputs(collapse_guard_law=str(_law_file(tmp_path, 0.01, placement="pre"))))
