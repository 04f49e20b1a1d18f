"""A non-finite gradient at one step is skipped on every path and the run goes on: across the skipped
step the fp32 masters, both Adam moments, the optimizer's step count, the lr schedule (its count and lr)
and the module weights are unchanged, tensor by tensor; the next step changes them; the skip is counted
(log line, TensorBoard) and the run reaches its last iteration. ``--max-consecutive-skipped-iterations``
stops a run that only skips, in one line; ``--iterations-to-skip`` consumes an iteration's batches
without a step.

The state is read from the torch optimizer DeepSpeed steps (tests/skip_inject.py), not through
megapost's code; the bad value enters one gradient element on global rank 0 only.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_ranks
from skip_inject import Case, run_cases

INF, NAN = float("inf"), float("nan")
KEYS = ("masters", "moments", "step", "module", "num_steps", "lr")


def _equal(a: dict, b: dict) -> dict[str, bool]:
    """Per key of ``KEYS``: every tensor (or value) of ``a`` equals ``b``'s bit for bit."""
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return x.shape == y.shape and bool(torch.equal(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y, strict=True))
        return x == y
    return {k: same(a[k], b[k]) for k in KEYS}


def check_skipped(case: Case, ranks: list[dict]) -> dict[str, bool]:
    """The assertions on one injected run; returns the row of the injection table (rank 0)."""
    k = case.inject[0]
    for rank, out in enumerate(ranks):
        before, after, next_ = (out["states"][s] for s in (k, k + 1, k + 2))
        unchanged = _equal(before, after)
        assert all(unchanged.values()), f"{case.name} rank {rank}: changed by the skipped step {unchanged}"
        assert before["moments"] and before["step"], f"{case.name}: no Adam state recorded"
        moved = _equal(after, next_)
        assert not moved["masters"] and not moved["moments"] and not moved["num_steps"], \
            f"{case.name} rank {rank}: the step after the skip did not train {moved}"
        assert after["num_steps"] == k - 1 and next_["num_steps"] == k, (after["num_steps"], k)
        assert {int(v.item()) for v in after["step"].values()} == {k - 1}, after["step"]
        assert out["error"] is None and out["iterations"] == case.steps, (out["error"], out["iterations"])
        assert out["skipped"] == 1, out["skipped"]
    assert ranks[0]["mode"] == "device"
    return {**unchanged, "skipped count": ranks[0]["skipped"]}


def _log_lines(out: dict) -> list[str]:
    return [line for line in out["stdout"].splitlines() if line.startswith(" iteration ") and "|" in line]


FAST = [Case("1 rank fp32 ZeRO-0 inf", ("--zero-stage", "0"), extra={"zero": 0}, tensorboard=True,
             save_interval=3),
        Case("1 rank bf16 NaN", ("--bf16",), value=NAN)]
ONE_RANK_SLOW = [Case("1 rank fp32 ZeRO-0 NaN, consecutive limit 2", ("--zero-stage", "0",
                      "--max-consecutive-skipped-iterations", "2", "--log-interval", "1"),
                      inject=(2, 3, 4, 5), value=NAN, watch=(), extra={"zero": 0}),
                 Case("1 rank bf16 --iterations-to-skip 3", ("--bf16",), inject=(), watch=(2, 3, 4, 5),
                      skip_iterations=(3,)),
                 Case("1 rank bf16 reference", ("--bf16",), inject=(), watch=())]


@pytest.mark.integration
def test_skip_one_rank_fp32_and_bf16_counted() -> None:
    results = run_ranks(run_cases, 1, FAST)[0]
    for case, out in zip(FAST, results, strict=True):
        print(case.name, check_skipped(case, [out]))
    lines = _log_lines(results[0])
    assert "skipped iterations 1" in lines[1] and "skipped iterations 0" in lines[0], lines  # steps 2, 4
    assert results[0]["skipped_scalar"] == {2: 0.0, 4: 1.0, 5: 0.0}, results[0]["skipped_scalar"]
    assert any(line.startswith(" saved checkpoint ") for line in results[0]["stdout"].splitlines())


@pytest.mark.integration
@pytest.mark.slow
def test_consecutive_limit_and_iterations_to_skip() -> None:
    limit, skipped, reference = run_ranks(run_cases, 1, ONE_RANK_SLOW)[0]
    assert limit["error"] is not None and limit["iterations"] == 3, (limit["error"], limit["iterations"])
    assert limit["error"].startswith("2 consecutive iterations skipped") and "at iteration 3;" in \
        limit["error"] and "no good checkpoint was saved" in limit["error"], limit["error"]
    assert all(_equal(skipped["after"][2], skipped["states"][4]).values())  # iteration 3: no step
    assert not all(_equal(skipped["states"][4], skipped["states"][5]).values())
    assert 3 not in skipped["tokens"] and 3 not in skipped["after"] and skipped["iterations"] == 5
    for step in (4, 5):  # later iterations read the batches an unskipped run reads there
        assert torch.equal(skipped["tokens"][step], reference["tokens"][step])
    assert skipped["skipped"] == 0


SLOW = [Case("DP2 ZeRO-0 fp32 NaN", ("--zero-stage", "0"), value=NAN, extra={"zero": 0}),
        Case("DP2 ZeRO-1 fp32 inf", ("--zero-stage", "1")),
        Case("DP2 ZeRO-1 bf16 NaN", ("--zero-stage", "1", "--bf16"), value=NAN),
        Case("DP2 ZeRO-2 bf16 inf", ("--zero-stage", "2", "--bf16"), extra={"zero": 2}),
        Case("DP2 ZeRO-2 fp32 NaN", ("--zero-stage", "2"), value=NAN, extra={"zero": 2}),
        Case("TP2 fp32 inf", ("--tensor-model-parallel-size", "2", "--zero-stage", "0"), extra={"zero": 0}),
        Case("TP2 bf16 NaN", ("--tensor-model-parallel-size", "2", "--bf16"), value=NAN),
        Case("PP2 fp32 NaN", ("--pipeline-model-parallel-size", "2"), value=NAN),
        Case("PP2 bf16 inf", ("--pipeline-model-parallel-size", "2", "--bf16"))]


def _table(cases: list[Case], results: list[list[dict]]) -> None:
    print("\npath | " + " | ".join(KEYS) + " | skipped count")
    for case, ranks in zip(cases, results, strict=True):
        row = check_skipped(case, ranks)
        print(f"{case.name} | " + " | ".join("unchanged" if row[k] else "CHANGED" for k in KEYS)
              + f" | {row['skipped count']}")


@pytest.mark.integration
def test_skip_dp2_zero2_bf16() -> None:
    """The default path on GPU (bf16, DP > 1: ZeRO-2), the issue's failing case."""
    cases = [SLOW[3]]
    by_rank = run_ranks(run_cases, 2, cases)
    _table(cases, [list(r) for r in zip(*by_rank, strict=True)])


@pytest.mark.integration
@pytest.mark.slow
def test_skip_every_two_rank_path() -> None:
    cases = [c for c in SLOW if c is not SLOW[3]]
    by_rank = run_ranks(run_cases, 2, cases, timeout=1800)
    _table(cases, [list(r) for r in zip(*by_rank, strict=True)])


def test_non_finite_decision() -> None:
    """DeepSpeed marks an invalid combined norm +inf, its group helpers -1; NaN stays NaN: all skip."""
    from megapost.ds_adapter.steps import non_finite

    norms = torch.tensor([INF, -INF, NAN, -1.0, 0.0, 3.5, 1e30])
    assert non_finite(norms).tolist() == [True, True, True, True, False, False, False]
    assert not math.isfinite(INF)


@pytest.mark.integration
def test_consecutive_limit_is_exact_between_log_steps() -> None:
    """A run of 2 skips (steps 2, 3) that ended before the log step 4 still stops the run (limit 2),
    naming the iteration the run reached the limit; read at the log step, no host read per step. With
    the log at 8 and a save at 4, the save is the check: it is refused (no tag is written)."""
    flags = ("--zero-stage", "0", "--max-consecutive-skipped-iterations", "2")
    cases = [Case("inf at 2 and 3, limit 2, log every 4", (*flags, "--log-interval", "4"), inject=(2, 3),
                  steps=8, watch=(), extra={"zero": 0}),
             Case("inf at 2 and 3, limit 2, log every 8, save every 4", (*flags, "--log-interval", "8"),
                  inject=(2, 3), steps=8, watch=(), save_interval=4, extra={"zero": 0})]
    for out in run_ranks(run_cases, 1, cases)[0]:
        print(out["error"])
        assert out["error"] is not None and out["iterations"] == 4, (out["error"], out["iterations"])
        assert out["error"].startswith("2 consecutive iterations skipped (non-finite gradient norm; "
                                       "--max-consecutive-skipped-iterations 2) (seen at iteration 4) at "
                                       "iteration 3; no good checkpoint was saved"), out["error"]
        assert not any("saved checkpoint" in line for line in out["stdout"].splitlines())


def _resume_pair(root: str, limit: int, first: tuple[int, ...], second: tuple[int, ...]) -> list[Case]:
    """Train 4 steps (save at 4) injecting at ``first``, then resume to 8 injecting at ``second``."""
    flags = ("--zero-stage", "0", "--max-consecutive-skipped-iterations", str(limit))
    return [Case(f"inf at {first}, saved at 4", flags, inject=first, steps=4, watch=(), save_interval=4,
                 tensorboard=True, extra={"zero": 0, "root": root, "data_steps": 8}),
            Case(f"resumed at 4, inf at {second}", flags, inject=second, steps=8, watch=(), save_interval=4,
                 tensorboard=True, extra={"zero": 0, "root": root, "resume": True})]


@pytest.mark.integration
@pytest.mark.slow
def test_skip_counts_continue_after_a_resume(tmp_path) -> None:
    """The skip counts are saved with the tag: after a resume the total continues (TensorBoard's
    per-interval series and the log line as an uninterrupted run writes them), and a run of consecutive
    skips that spans the save stops the resumed run at the limit."""
    count = _resume_pair(str(tmp_path / "count"), 10, (3,), (6,))
    streak = _resume_pair(str(tmp_path / "streak"), 3, (3, 4), (5,))
    a, b, c, d = run_ranks(run_cases, 1, count + streak)[0]
    assert a["error"] is None and a["skipped"] == 1 and a["iterations"] == 4
    assert b["error"] is None and b["iterations"] == 8
    assert b["skipped"] == 2, b["skipped"]  # steps 3 and 6 (a total from zero would say 1)
    assert b["skipped_scalar"] == {2: 0.0, 4: 1.0, 6: 1.0, 8: 0.0}, b["skipped_scalar"]
    assert [line.split("skipped iterations ")[1][0] for line in _log_lines(b)] == ["1", "0"]  # steps 6, 8
    assert c["error"] is None and c["skipped"] == 2 and c["iterations"] == 4
    assert d["error"] is not None and d["error"].startswith("3 consecutive iterations skipped") and \
        " at iteration 5;" in d["error"] and "iter_0000004" in d["error"], d["error"]
    assert d["skipped"] == 3 and d["iterations"] == 6, (d["skipped"], d["iterations"])
