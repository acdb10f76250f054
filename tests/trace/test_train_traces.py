"""Real traces: `deltamoe train` under torchrun with gloo, dp2 x pp2, one stage slowed down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltamoe.trace.analyze import analyze

SLOW_RANK = 2  # stage 1 of the pipeline [0, 2] (the mesh is pp x dp: pipelines [0, 2] and [1, 3])


@pytest.fixture(scope="module")
def train_traces(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("train")
    script = Path(__file__).with_name("slow_stage_train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script),
           str(SLOW_RANK), "0.2", "--", "--preset", "tiny", "--task", "recall", "--dp", "2", "--pp", "2",
           "--microbatches", "4", "--batch-size", "8", "--steps", "5", "--profile-steps", "3:5", "--out", str(out),
           "--eval-every", "0", "--save-every", "0", "--no-progress", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((out / "traces").glob("rank*.json"))) == 4
    return str(out / "traces")


@pytest.mark.slow
def test_train_pipeline_and_slow_stage_are_found(train_traces):
    rep = analyze(train_traces, workers=2).report
    assert rep["ranks_analyzed"] == 4 and rep["backend"] == "gloo" and rep["skipped"] == []
    pipe = rep["pipeline"]
    # P2P peers are group ranks of the pipeline groups (mesh_pp): mapped back to global ranks.
    assert pipe is not None and pipe["pipelines_ranks"] == [[0, 2], [1, 3]]
    assert pipe["stages"] == 2 and pipe["microbatches"] == 4
    assert rep["p2p_matched"] == 2 * 2 * 4 * 2  # steps x pipelines x microbatches x (activation + gradient)
    # The slowed rank is named, and only it: with four ranks by the small-job test (its score at
    # least 3x every other rank's), as the robust z of four scores is no baseline.
    ranking = rep["straggler_detail"]["ranking"]
    assert ranking[0]["rank"] == SLOW_RANK, ranking
    assert [s["rank"] for s in rep["stragglers"]] == [SLOW_RANK], (rep["stragglers"], ranking)
