"""The validation table: one row per published figure, ratios in 0.5x-2x except the documented outlier."""

from deltamoe.plan.validate import HIGH, LOW, run_validation

# vLLM-Ascend K3 with DSpark: the drafter's passes and Ascend collective latencies are not modelled
# (docs/planner.md explains); a change that moves other rows out of range must be looked at.
KNOWN_OUTLIERS = {"k3-a3-dspark-tpot"}


def test_every_figure_has_a_row_with_a_ratio():
    rows = run_validation()
    keys = {r.key for r in rows}
    assert {"dsv3-prod-prefill", "dsv3-prod-decode", "sglang-h100-prefill", "sglang-h100-decode",
            "k2-h200-prefill", "k2-h200-decode", "k3-b300-c1-tpot", "k3-gb200-decode", "k3-a3-dspark-tpot"} <= keys
    for r in rows:
        assert r.published > 0 and r.estimate > 0 and r.source
        assert r.ratio == r.estimate / r.published


def test_ratios_within_goal_except_documented_outliers():
    rows = run_validation()
    outside = {r.key for r in rows if not LOW <= r.ratio <= HIGH}
    assert outside == KNOWN_OUTLIERS
    for r in rows:
        if r.key in KNOWN_OUTLIERS:
            assert r.note  # an outlier always carries its explanation
