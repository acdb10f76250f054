"""Scale checks (slow): a 1,024-rank pipeline job, analysed with two workers."""

from __future__ import annotations

import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.synth import SynthConfig, generate


@pytest.mark.slow
def test_1024_ranks_straggler_and_bubbles(tmp_path):
    truth = generate(SynthConfig(ranks=1024, steps=3, pp=4, layers=1, stragglers=(300,), slowdown=1.3,
                                 compact=True, gz=True), tmp_path, workers=2)
    rep = analyze(str(tmp_path), workers=2).report
    assert rep["ranks_analyzed"] == 1024
    assert [s["rank"] for s in rep["stragglers"]] == [300]
    for stage, frac in truth["pipeline"]["bubble_fraction"].items():
        assert abs(rep["bubble_fraction"][stage] - frac) < 0.02
