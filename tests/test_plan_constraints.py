"""The planner takes the trainer's layout flags, when typed, as constraints."""

from __future__ import annotations

from megapost.plan.__main__ import parse, plan


def test_typed_layout_flags_constrain_the_search() -> None:
    free = plan(parse(["--preset", "llama-7b", "--gpus", "16"]))
    assert {r["layout"]["zero_stage"] for r in free["fitting"]} == {1, 2}
    fixed = plan(parse(["--preset", "llama-7b", "--gpus", "16", "--zero-stage", "2",
                        "--tensor-model-parallel-size", "2", "--checkpoint-activations"]))
    rows = fixed["fitting"] + fixed["not_fitting"]
    assert rows and all(r["layout"]["zero_stage"] == 2 and r["layout"]["tp"] == 2
                        and r["layout"]["checkpoint"] for r in rows)
