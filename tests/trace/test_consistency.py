"""Inconsistent jobs are reported, never silently mis-analysed; usage errors exit 2."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from deltamoe.errors import TraceError
from deltamoe.trace.__main__ import main as trace_main
from deltamoe.trace.analyze import analyze
from deltamoe.trace.reader import ReadConfig
from deltamoe.trace.synth import SynthConfig, generate


def _edit(path: Path, fn) -> None:
    doc = orjson.loads(path.read_bytes())
    fn(doc)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def _drop_first_all_to_alls(doc: dict, n: int = 3) -> None:
    out, dropped = [], 0
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("args", {}).get("Collective name") == "all_to_allv" and dropped < n:
            dropped += 1
            continue
        out.append(e)
    doc["traceEvents"] = out


@pytest.fixture()
def job(tmp_path) -> Path:
    generate(SynthConfig(ranks=8, steps=3, stragglers=(6,), slowdown=1.3), tmp_path)
    return tmp_path


def test_rank_lacking_collectives_is_named_not_blamed(job):
    _edit(job / "rank3.pt.trace.json", _drop_first_all_to_alls)
    rep = analyze(str(job), workers=1).report
    c = rep["consistency"]
    assert {(u["rank"], u["seq"]) for u in c["unmatched_collectives"]} == {(3, 0), (3, 1), (3, 2)}
    assert any("rank 3 lacks 3 collective(s)" in w and "sequence 0, 1, 2" in w for w in c["warnings"])
    # The later all-to-alls of rank 3 are matched with the right instances: the real straggler
    # stays the only one, and nobody "waited" longer than a step.
    assert [s["rank"] for s in rep["stragglers"]] == [6]
    step = max(rep["ranks"][0]["step_s"])
    assert all(x["others_waited_s"] / x["count"] < step for x in rep["stragglers"][0]["collectives"])


def test_missing_rank_file_is_reported(job):
    (job / "rank5.pt.trace.json").unlink()
    rep = analyze(str(job), workers=1).report
    assert rep["ranks_analyzed"] == 7 and rep["consistency"]["world_size"] == 8
    assert rep["consistency"]["missing_ranks"] == [5]
    assert any("1 of 8 rank files missing (ranks 5)" in w for w in rep["consistency"]["warnings"])
    assert [s["rank"] for s in rep["stragglers"]] == [6]


def test_rank_outside_the_world_is_skipped_with_a_reason(job):
    _edit(job / "rank2.pt.trace.json", lambda d: d["distributedInfo"].update(rank=9))
    rep = analyze(str(job), workers=1).report
    assert [Path(s["path"]).name for s in rep["skipped"]] == ["rank2.pt.trace.json"]
    assert "rank 9 outside the world size 8" in rep["skipped"][0]["error"]
    assert rep["consistency"]["missing_ranks"] == [2]


def test_steps_outside_the_trace_is_a_usage_error(job, capsys):
    with pytest.raises(TraceError, match="no step of 10:12 in the traces \\(they hold steps 1..3\\)"):
        analyze(str(job), ReadConfig(steps=(10, 12)), workers=1)
    assert trace_main(["analyze", str(job), "--steps", "10:12", "--quiet", "--workers", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: --steps: no step of 10:12")


def test_invalid_comm_pattern_is_a_usage_error(job, capsys):
    assert trace_main(["analyze", str(job), "--comm-pattern", "(", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --comm-pattern: invalid regular expression '('")


def test_profiler_step_offset_maps_steps_to_training_steps(job):
    """A recorder that writes `profiler_step_offset` gets its training step numbers back."""
    for p in job.glob("rank*.json"):
        _edit(p, lambda d: d.update(profiler_step_offset=2))
    rep = analyze(str(job), ReadConfig(steps=(4, 6)), workers=1).report
    assert [s["step"] for s in rep["step_times"]["steps"]] == [4, 5]


def _kernel_durations(doc: dict, value: float, n: int = 5) -> None:
    """The first `n` compute kernels' dur set to `value`."""
    changed = 0
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and "Collective name" not in e.get("args", {}) and changed < n:
            e["dur"] = value
            changed += 1


def test_negative_durations_are_warned_and_read_as_zero(tmp_path):
    """A dur < 0 (a broken clock or a hand-edited file) is named in a warning and read as a
    zero-length event: the report equals the one whose events say dur 0."""
    reports = {}
    for value in (-500.0, 0.0):
        folder = tmp_path / str(value)
        generate(SynthConfig(ranks=4, steps=3), folder)
        _edit(folder / "rank2.pt.trace.json", lambda doc: _kernel_durations(doc, value))
        reports[value] = analyze(str(folder), workers=1).report
    negative, zero = reports[-500.0], reports[0.0]
    assert any("rank 2: 5 event(s) with a negative duration" in w for w in negative["consistency"]["warnings"])
    assert not any("negative" in w for w in zero["consistency"]["warnings"])
    assert negative["ranks"] == zero["ranks"]
