"""End to end on a real torch.profiler trace of a 4-rank gloo job (CPU only, loopback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deltamoe.trace.analyze import analyze


@pytest.fixture(scope="module")
def gloo_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    job = Path(__file__).with_name("gloo_job.py")
    proc = subprocess.run([sys.executable, str(job), str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(out.glob("*.json"))) == 4
    return str(out)


def test_gloo_job_end_to_end(gloo_traces):
    rep = analyze(gloo_traces, workers=2).report
    assert rep["ranks_analyzed"] == 4 and rep["skipped"] == []
    assert rep["backend"] == "gloo" and rep["mode"] == "cpu"
    # 3 profiled steps; per step 2 microbatches x (activation + gradient) per pipeline.
    assert rep["p2p_matched"] == 3 * 2 * 2 * 2
    # One all-reduce per step in each DP group, placed in groups {0,2} and {1,3} by overlap in time.
    assert rep["collectives_matched"] == 3 * 2
    pipe = rep["pipeline"]
    assert pipe["pipelines_ranks"] == [[0, 1], [2, 3]] and pipe["microbatches"] == 2
    assert pipe["theoretical_bubble_fraction"] == pytest.approx(1 / 3)
    for r in rep["ranks"]:
        parts = r["compute_s"] + r["exposed_comm_s"] + r["memcpy_s"] + r["idle_s"]
        assert parts == pytest.approx(r["time_s"], rel=1e-6)
        assert r["compute_s"] > 0 and r["comm_s"] > 0
    # Rank 3 sleeps 2 x 80 ms per step; the others wait for it.
    assert [s["rank"] for s in rep["stragglers"]] == [3]
    assert rep["stragglers"][0]["others_waited_s"] > 0.15
