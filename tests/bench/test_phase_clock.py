"""bench/decode_step_split.py's PhaseClock, which bench/offline_step_split.py splits the offline run
with: a phase entered again from inside itself (the engine's `_postprocess` for a multi-step window's
tokens) counts once, in time and in calls."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_phase_entered_from_itself_counts_once(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports common beside it
    clock = importlib.import_module("decode_step_split").PhaseClock()

    def outer(depth: int) -> int:
        busy(0.01)
        return depth if depth == 0 else wrapped(depth - 1)

    wrapped = clock.wrap("postprocess", outer)
    start = time.thread_time()
    assert wrapped(3) == 0
    total = time.thread_time() - start
    assert clock.calls["postprocess"] == 1
    assert 0.04 <= clock.seconds["postprocess"] <= total  # four nested calls' work, counted once
    wrapped(0)
    assert clock.calls["postprocess"] == 2
