"""Collective time = waiting for late peers (skew) + transfer, against the generator's model."""

from __future__ import annotations

import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.synth.program import A2A_US


def test_skew_and_transfer_split(pipeline_job):
    folder, truth = pipeline_job
    rep = analyze(folder, workers=1).report
    sk = rep["sync_skew"]
    a2a = [g for g in sk["groups"] if g["kind"] == "all_to_all"]
    # The generator finishes a collective A2A_US after its last member arrives: that is the transfer.
    for g in a2a:
        assert g["transfer_s"] == pytest.approx(g["instances"] * 4 * A2A_US / 1e6, rel=1e-3)
    # The straggler (rank 5) arrives last: it waits for nobody; its expert group waits for it.
    by_rank = {r["rank"]: r for r in sk["ranks"]}
    assert by_rank[5]["sync_wait_s"] < 0.1 * min(by_rank[r]["sync_wait_s"] for r in (4, 6, 7))
    worst = a2a[0]
    assert worst["sync_fraction"] > 0.3 and worst["max_skew_s"] >= worst["mean_skew_s"] > 0
    assert sk["sync_wait_s"] == pytest.approx(sum(r["sync_wait_s"] for r in sk["ranks"]), rel=1e-3)
