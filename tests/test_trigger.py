"""megapost/study/trigger.py: the trigger experiment's analysis, on fake replica records whose answers are
counted or computed here by hand (published Wilson intervals, binomial tails, a closed-form logistic fit)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megapost.study import trigger


def rec(snapshot, replica, collapsed, intervention="none", **features):
    return {"schema": trigger.SCHEMA, "version": trigger.VERSION, "snapshot": snapshot, "replica": replica,
            "intervention": intervention, "event": "delayed" if collapsed else "survived",
            "event_step": snapshot + 100 if collapsed else None, "last_step": 1300, "final_loss": 6.5,
            "features": features}


def test_wilson_matches_published_intervals():
    # Wilson 95 % (z = 1.96): 5/10 -> [0.2366, 0.7634]; 0/12 -> [0, z^2 / (n + z^2)] = [0, 0.2425]
    assert trigger.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert trigger.wilson(0, 12) == pytest.approx((0.0, 3.8415 / 15.8415), abs=1e-4)
    assert trigger.wilson(12, 12)[1] == 1.0
    assert all(math.isnan(v) for v in trigger.wilson(0, 0))


def test_poisson_interval_is_the_exact_one():
    # exact 95 % (Garwood, chi-square quantiles / 2): k = 0 -> [0, 3.689]; 1 -> [0.0253, 5.572];
    # 10 -> [4.795, 18.39]
    for k, lo, hi in ((0, 0.0, 3.689), (1, 0.0253, 5.572), (10, 4.795, 18.39)):
        got = trigger.poisson_interval(k)
        assert got[0] == pytest.approx(lo, rel=2e-3, abs=1e-9) and got[1] == pytest.approx(hi, rel=2e-3)


def test_hazard_counts_the_steps_each_replica_was_at_risk():
    # snapshot 900: two collapse at 1000 and 1100 (100 + 200 steps at risk), one survives to 1300
    # (confirmable to 1200: 300 steps) -> 2 events / 600 steps = 0.333 per 100 steps
    records = [rec(900, 0, True), {**rec(900, 1, True), "event_step": 1100}, rec(900, 2, False)]
    (row,) = trigger.decision_table(records)
    assert row["risk_steps"] == 600 and row["hazard"] == pytest.approx(100 * 2 / 600)
    assert row["hazard_hi"] == pytest.approx(100 * trigger.poisson_interval(2)[1] / 600)


def test_sign_test_is_the_exact_binomial_tail():
    assert trigger.sign_test(0, 5) == pytest.approx(2 / 32)  # 2 * (1/2)^5
    assert trigger.sign_test(1, 5) == pytest.approx(2 * 7 / 64)  # 2 * (1 + 6) / 2^6
    assert trigger.sign_test(3, 3) == 1.0
    assert trigger.sign_test(0, 0) == 1.0


def test_decision_table_counts_controls_only_and_finds_where_it_is_decided():
    records = [rec(500, r, r < 2) for r in range(8)] + [rec(800, r, r < 7) for r in range(8)]
    records += [rec(900, r, True) for r in range(8)] + [rec(900, r, False, "eps1e-6") for r in range(8)]
    table = trigger.decision_table(records)
    assert [(r["snapshot"], r["collapsed"], r["n"]) for r in table] == [(500, 2, 8), (800, 7, 8), (900, 8, 8)]
    assert table[2]["event_steps"] == [1000] * 8
    assert trigger.decided_from(table) == {"outcome": "yes", "step": 900, "level": 0.9, "key": "p"}
    assert trigger.decided_from(table, level=0.85)["step"] == 800  # 7/8 = 0.875
    open_end = table[:1]
    assert trigger.decided_from(open_end)["outcome"] is None
    survive = [{"snapshot": 1, "p": 0.0}, {"snapshot": 2, "p": 0.05}]
    assert trigger.decided_from(survive) == {"outcome": "no", "step": 1, "level": 0.9, "key": "p"}
    # no final gap recorded: nobody is healthy, so "lost" is decided from the first snapshot
    assert [r["p_lost"] for r in table] == [1.0, 1.0, 1.0]
    assert trigger.decided_from(table, key="p_lost")["step"] == 500


def test_stratified_auc_compares_only_replicas_of_one_snapshot():
    # snapshot A: collapsed x = 2, survived x = 1 and 3 -> 1 win of 2 pairs; snapshot B: collapsed 10 and
    # 10 vs survived 10 -> 2 ties of 2 pairs (1/2 each). Within: (1 + 1) / 4 = 0.5. Pooled (9 pairs):
    # 2 beats 1; each 10 beats 1 and 3 and ties 10 (2.5 each) -> 6 / 9.
    x = np.array([2.0, 1.0, 3.0, 10.0, 10.0, 10.0])
    y = np.array([1, 0, 0, 1, 1, 0])
    strata = np.array([0, 0, 0, 1, 1, 1])
    assert trigger.stratified_auc(x, y, strata) == pytest.approx(0.5)
    assert trigger.stratified_auc(x, y, np.zeros(6)) == pytest.approx(6 / 9)
    assert math.isnan(trigger.stratified_auc(x, np.ones(6, int), strata))


def test_separation_names_the_feature_that_separates_within_snapshots():
    records = []
    for s in (500, 900):
        for r in range(6):
            c = r < 3
            records.append(rec(s, r, c, resid_deep=(100.0 if c else 10.0) * (1 + r / 100), attn_s_top=1.0 + r,
                               one_minus_tsim=0.5, adam_v_first=None))
    out = {s["feature"]: s for s in trigger.separation(records, draws=200)}
    lost = {s["feature"]: s for s in trigger.separation(records, draws=10, outcome=trigger.lost)}
    assert lost["resid_deep"]["pairs"] == 0  # no final gap: every replica is lost, nothing to compare
    assert out["resid_deep"]["auc"] == 1.0 and out["resid_deep"]["pairs"] == 18
    assert out["one_minus_tsim"]["auc"] == 0.5  # all equal: ties
    assert out["attn_s_top"]["auc"] == 0.0  # collapsed replicas r < 3 have the smaller values
    assert out["adam_v_first"]["n"] == 0 and math.isnan(out["adam_v_first"]["auc"])


def test_logistic_on_one_binary_covariate_is_the_log_odds_ratio():
    # 2 x 2 table: x = 1: 6 collapsed of 8; x = 0: 2 of 8 -> log OR = log(3 / (1/3)) = log 9; per SD of x
    # (x has mean 1/2 and SD 1/2): the slope is log(9) / 2; the intercept (at x's mean) is 0 by symmetry.
    x = np.array([1.0] * 8 + [0.0] * 8)[:, None]
    y = np.array([1] * 6 + [0] * 2 + [1] * 2 + [0] * 6, dtype=float)
    fit = trigger.logistic(x, y, ridge=0.0)
    assert fit["coef"][1] == pytest.approx(math.log(9) / 2, rel=1e-6)
    assert fit["coef"][0] == pytest.approx(0.0, abs=1e-9)
    # Wald SE of the log OR: sqrt(1/6 + 1/2 + 1/2 + 1/6); per SD: half of it
    se = math.sqrt(1 / 6 + 1 / 2 + 1 / 2 + 1 / 6) / 2
    assert fit["se"][1] == pytest.approx(se, rel=1e-6)
    assert fit["lo"][1] == pytest.approx(math.log(9) / 2 - trigger.Z95 * se, rel=1e-6)


def test_regression_needs_outcomes_that_vary():
    same = [rec(500, r, True, resid_deep=1.0 + r, attn_s_top=1.0, one_minus_tsim=0.1 * (r + 1),
                adam_v_first=1e-8 * (r + 1)) for r in range(6)]
    assert trigger.regression(same) is None
    mixed = same + [rec(700, r, False, resid_deep=0.5 + r, attn_s_top=2.0, one_minus_tsim=0.05 * (r + 1),
                        adam_v_first=1e-9 * (r + 2)) for r in range(6)]
    fit = trigger.regression(mixed)
    assert fit["terms"] == ["intercept", "resid_deep", "attn_s_top", "one_minus_tsim", "adam_v_first"]
    assert fit["n"] == 12 and fit["events"] == 6


def test_rescues_pair_each_treated_replica_with_its_own_control():
    controls = [rec(850, r, r < 4) for r in range(6)]  # replicas 0-3 collapse untreated
    treated = [rec(850, r, r in (1, 4), "wo_lr0.1") for r in range(6)]  # rescues 0, 2, 3; harms 4
    other = [rec(700, 0, True, "wo_lr0.1")]  # no control for it: left out
    (row,) = trigger.rescues(controls + treated + other)
    assert (row["at_risk"], row["rescued"], row["harmed"], row["pairs"]) == (4, 3, 1, 6)
    assert (row["collapsed"], row["control_collapsed"]) == (2, 4)
    assert row["rescued_ci"] == trigger.wilson(3, 4)
    assert row["sign_test_p"] == pytest.approx(2 * 5 / 16)  # 3 vs 1 discordant: 2 * (1 + 4) / 2^4


def test_merge_keeps_one_record_per_job_and_reports_disagreements():
    a = [rec(500, 0, True), rec(500, 1, False)]
    b = [rec(500, 0, True), rec(500, 2, True)]
    merged, conflicts = trigger.merge([a, b])
    assert len(merged) == 3 and conflicts == []
    c = [{**rec(500, 1, True)}]
    merged, conflicts = trigger.merge([a, c])
    assert len(merged) == 2 and len(conflicts) == 1 and "replica 1" in conflicts[0]


def test_read_records_refuses_another_schema(tmp_path):
    path = tmp_path / "replicas.jsonl"
    path.write_text(json.dumps(rec(500, 0, True)) + "\n\n" + json.dumps({"schema": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"replicas.jsonl:3: not a megapost.trigger"):
        trigger.read_records(path)
    path.write_text(json.dumps(rec(500, 0, True)) + "\n")
    assert trigger.read_records(path)[0]["replica"] == 0


def test_markdown_shows_every_table():
    records = [rec(500, r, r < 3, resid_deep=10.0 * (1 + (r < 3)) + r, attn_s_top=1.0 + r, one_minus_tsim=0.3,
                   adam_v_first=1e-8 * (r + 1)) for r in range(6)]
    records += [rec(500, r, r == 0, "eps1e-6") for r in range(6)]
    text = trigger.markdown(trigger.summary(records))
    assert "| 500 | 3/6 | 0.50 |" in text
    assert "| 500 | eps1e-6 | 2/3 |" in text
    assert "Logistic regression" in text and "| resid_deep |" in text


def test_final_gap_is_the_trailing_mean_and_healthy_needs_it_below_the_learned_gap():
    # last 5 measured losses 6.1 .. 6.5 (one missing before them): mean 6.3, L = 6.5 -> -0.2
    assert trigger.final_gap([None, 6.0, 6.1, 6.2, 6.3, 6.4, 6.5], 6.5) == pytest.approx(-0.2)
    assert trigger.final_gap([None, float("nan")], 6.5) is None
    assert not trigger.healthy({**rec(700, 1, False), "final_gap": -0.2})
    assert trigger.healthy({**rec(700, 1, False), "final_gap": -0.4})
    assert not trigger.healthy({**rec(700, 1, True), "final_gap": -0.4})  # collapsed
    assert not trigger.healthy(rec(700, 1, False))  # no final gap recorded


def test_series_names_match_the_runner_files():
    assert trigger.series_name(rec(850, 0, True)) == "base"
    assert trigger.series_name(rec(850, 0, True, "eps1e-6")) == "S850_r0_eps1e-6"
    assert trigger.series_name(rec(850, 3, False)) == "S850_r3_none"


def test_health_is_counted_per_snapshot_and_per_pair():
    gaps = [-0.5, -0.1, 0.05, 0.2]  # one healthy survivor, one survivor at the plateau, two collapsed
    controls = [{**rec(700, r, r >= 2), "final_gap": g} for r, g in enumerate(gaps)]
    (row,) = trigger.decision_table(controls)
    assert (row["healthy"], row["n"]) == (1, 4) and row["median_final_gap"] == pytest.approx(-0.025)
    treated = [{**rec(700, r, False, "freeze_gains"), "final_gap": g}
               for r, g in enumerate([-0.6, -0.4, -0.05, -0.35])]  # healthy: replicas 0, 1, 3
    (res,) = trigger.rescues(controls + treated)
    assert (res["healthy"], res["control_healthy"], res["to_health"], res["from_health"]) == (3, 1, 2, 0)
    assert res["health_sign_test_p"] == pytest.approx(0.5)  # 2 vs 0: 2 * (1/2)^2
    assert (res["at_risk"], res["rescued"]) == (2, 2)


def test_base_table_shows_the_base_state_once_per_snapshot():
    state = {"loss": 6.2, "t_sim_head": 0.45, "grad_ratio": 6.6, "resid": [105.0, 277.0], "resid_deep": 277.0,
             "attn_s": [2.3, 0.6], "attn_s_top": 0.6, "adam_v_first": 1e-7}
    records = [{**rec(700, r, r == 0), "snapshot_features": state, "freq_loss": 6.5} for r in range(3)]
    summ = trigger.summary(records)
    assert summ["base"] == [{"snapshot": 700, **state}]
    assert "| 700 | -0.30 | 0.45 | 6.6 | 105 / 277 | 2.3 / 0.6 | 1e-07 |" in trigger.markdown(summ)
