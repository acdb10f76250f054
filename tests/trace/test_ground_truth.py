"""The analyzer recovers what the synthetic generator injected."""

from __future__ import annotations

import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.synth import SynthConfig, generate


def _ranks(report: dict) -> list[int]:
    return sorted(s["rank"] for s in report["stragglers"])


def test_pipeline_straggler_not_last_stage_is_found(pipeline_job):
    folder, truth = pipeline_job
    rep = analyze(folder, workers=1).report
    assert _ranks(rep) == truth["stragglers"] == [5]
    s = rep["stragglers"][0]
    assert s["own_compute_slower"] and s["compute_vs_peers"] == pytest.approx(1.3, abs=0.03)
    assert s["cause"] == "slow compute"
    # Its downstream stages (ranks 9, 13) wait too; they must not be blamed.
    assert rep["pipeline"]["stage_of_rank"]["5"] == 1
    assert rep["pipeline"]["stages"] == 4 and rep["pipeline"]["microbatches"] == 8


def test_clean_job_has_no_stragglers_and_bubbles_match(clean_pipeline_job):
    folder, truth = clean_pipeline_job
    rep = analyze(folder, workers=2).report
    assert rep["stragglers"] == []
    pipe = rep["pipeline"]
    assert pipe["theoretical_bubble_fraction"] == pytest.approx(3 / 11)
    for stage, frac in truth["pipeline"]["bubble_fraction"].items():
        assert abs(pipe["bubble_fraction"][stage] - frac) < 0.02
    # Uniform stages: the measured bubble is the 1F1B formula plus exposed pipeline transfers.
    assert abs(pipe["bubble_fraction_mean"] - pipe["theoretical_bubble_fraction"]) < 0.03


def test_bubbles_with_straggler_match_truth(pipeline_job):
    folder, truth = pipeline_job
    rep = analyze(folder, workers=1).report
    for stage, frac in truth["pipeline"]["bubble_fraction"].items():
        assert abs(rep["bubble_fraction"][stage] - frac) < 0.02


@pytest.mark.parametrize("job", ["pipeline_job", "dp_job"])
def test_breakdown_within_two_percent(job, request):
    folder, truth = request.getfixturevalue(job)
    rep = analyze(folder, workers=1).report
    by_rank = {r["rank"]: r for r in rep["ranks"]}
    assert len(by_rank) == len(truth["ranks"])
    for t in truth["ranks"]:
        got = by_rank[t["rank"]]
        for key in ("compute_s", "comm_s", "overlap_s"):
            assert got[key] == pytest.approx(t[key], rel=0.02), (t["rank"], key)
        assert got["idle_s"] == pytest.approx(t["idle_s"], rel=0.02, abs=1e-5)
        assert got["memcpy_s"] == pytest.approx(t["memcpy_s"], rel=0.02, abs=1e-6)
        assert got["step_s"] == pytest.approx(t["step_s"], rel=0.02)


def test_two_stragglers_without_pipeline(dp_job):
    folder, truth = dp_job
    rep = analyze(folder, workers=1).report
    assert _ranks(rep) == [3, 12]
    assert rep["pipeline"] is None and rep["bubble_fraction"] is None
    assert all(s["own_compute_slower"] for s in rep["stragglers"])


def test_moe_hot_rank_is_imbalance_not_straggler(tmp_path):
    generate(SynthConfig(ranks=16, steps=2, hot_ranks=((2, 2.0),)), tmp_path)
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["stragglers"] == []
    a2a = rep["alltoall"]
    assert [h["rank"] for h in a2a["hot_ranks"]] == [2]
    assert a2a["hot_ranks"][0]["bytes_vs_median"] == pytest.approx(2.0)
    assert rep["straggler_detail"]["explained_by_imbalance"][0]["rank"] == 2


def test_steps_filter_keeps_only_selected(pipeline_job):
    folder, _ = pipeline_job
    rep = analyze(folder, workers=1).report
    from deltamoe.trace.reader import ReadConfig
    sub = analyze(folder, ReadConfig(steps=(2, 3)), workers=1).report
    assert [s["step"] for s in sub["step_times"]["steps"]] == [2]
    assert all(len(r["step_s"]) == 1 for r in sub["ranks"])
    assert sub["ranks"][0]["step_s"][0] == pytest.approx(rep["ranks"][0]["step_s"][1])
