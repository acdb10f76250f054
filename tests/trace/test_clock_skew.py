"""A rank whose clock is off the others' is corrected (trace/clock.py), not only warned about.

`data/gloo_dp_slow2` is a real 4-rank gloo data-parallel job (all-reduce and all-to-all over
the world) whose rank 2 computes about 3x slower than the others."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from deltamoe.trace import clock
from deltamoe.trace.analyze import analyze
from deltamoe.trace.synth import SynthConfig, generate

DATA = Path(__file__).with_name("data")
GLOO_DP = DATA / "gloo_dp_slow2"


def _shift_copy(src: Path, dst: Path, rank: int, by_us: float) -> str:
    """Copy a job's rank files, moving every timestamp of `rank`'s file by `by_us`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.name.endswith((".json", ".json.gz")) or f.name.startswith("_"):
            continue
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt") as fh:
            doc = json.load(fh)
        if doc["distributedInfo"]["rank"] == rank:
            for e in doc["traceEvents"]:
                if "ts" in e:
                    e["ts"] = float(e["ts"]) + by_us
        with opener(dst / f.name, "wt") as fh:
            json.dump(doc, fh)
    return str(dst)


def _no_correction(monkeypatch):
    monkeypatch.setattr(clock, "ROUNDS", 0)


def _clock_warnings(rep: dict) -> list[str]:
    return [w for w in rep["consistency"]["warnings"] if "clock" in w]


@pytest.mark.parametrize("rank,by_us", [(1, 200e3), (3, -200e3), (0, 5e3)])
def test_gloo_job_with_a_skewed_rank_is_analysed_as_the_unskewed_one(tmp_path, rank, by_us):
    base = analyze(str(GLOO_DP), workers=1).report
    assert [s["rank"] for s in base["stragglers"]] == [2]
    rep = analyze(_shift_copy(GLOO_DP, tmp_path / "skewed", rank, by_us), workers=1).report
    # Uncorrected, +200 ms left every gloo op in no process group and no straggler found.
    assert [s["rank"] for s in rep["stragglers"]] == [2]
    assert rep["collectives_matched"] == base["collectives_matched"]
    assert not any("matched no process group" in w or "different jobs" in w for w in rep["consistency"]["warnings"])
    assert rep["consistency"]["unmatched_count"] == base["consistency"]["unmatched_count"]
    assert rep["consistency"]["clock_offsets_ms"] == {str(rank): pytest.approx(by_us / 1e3, abs=0.5)}
    (w,) = _clock_warnings(rep)
    assert f"rank {rank}:" in w and "corrected" in w
    assert rep["stragglers"][0]["score"] == pytest.approx(base["stragglers"][0]["score"], abs=0.02)
    sk, sk0 = rep["sync_skew"], base["sync_skew"]
    assert sk["sync_wait_s"] == pytest.approx(sk0["sync_wait_s"], rel=0.02)


def test_pipeline_bubbles_and_straggler_survive_a_skewed_rank(tmp_path):
    truth = generate(SynthConfig(ranks=16, steps=2, pp=4, stragglers=(5,), slowdown=1.3), tmp_path / "job")
    base = analyze(str(tmp_path / "job"), workers=1).report
    rep = analyze(_shift_copy(tmp_path / "job", tmp_path / "skewed", 6, 50e3), workers=1).report
    assert [s["rank"] for s in rep["stragglers"]] == [s["rank"] for s in base["stragglers"]] == truth["stragglers"]
    assert rep["collectives_matched"] == base["collectives_matched"]
    assert rep["p2p_matched"] == base["p2p_matched"]
    assert rep["bubble_fraction"].keys() == base["bubble_fraction"].keys()
    for stage, frac in base["bubble_fraction"].items():
        assert rep["bubble_fraction"][stage] == pytest.approx(frac, abs=0.002)
    assert rep["consistency"]["clock_offsets_ms"] == {"6": pytest.approx(50.0, abs=0.1)}


@pytest.mark.parametrize("folder", [GLOO_DP, DATA / "gloo_loaded" / "run1", DATA / "gloo_loaded" / "run4"])
def test_unskewed_real_jobs_are_left_as_they_are(folder, monkeypatch):
    rep = analyze(str(folder), workers=1).report
    assert rep["consistency"]["clock_offsets_ms"] == {} and not _clock_warnings(rep)
    _no_correction(monkeypatch)
    old = analyze(str(folder), workers=1).report
    for k in ("stragglers", "straggler_detail", "sync_skew", "collectives_matched", "pipeline"):
        assert rep[k] == old[k]


def test_unskewed_synthetic_job_is_left_as_it_is(pipeline_job, monkeypatch):
    folder, _ = pipeline_job
    rep = analyze(folder, workers=1).report
    assert rep["consistency"]["clock_offsets_ms"] == {} and not _clock_warnings(rep)
    _no_correction(monkeypatch)
    old = analyze(folder, workers=1).report
    for k in ("stragglers", "straggler_detail", "sync_skew", "bubble_fraction", "collectives_matched"):
        assert rep[k] == old[k]


def test_uncorrected_when_the_estimate_is_not_trustworthy(tmp_path):
    """Below MIN_OFFSET_US the ends of a collective's members differ by noise: nothing moves."""
    rep = analyze(_shift_copy(GLOO_DP, tmp_path / "small", 1, 300.0), workers=1).report
    assert rep["consistency"]["clock_offsets_ms"] == {}
