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


def test_instrument_wraps_what_a_real_engine_has(monkeypatch) -> None:
    """`instrument` names engine and runner methods by hand: a rename there (the runner's `_sample`
    became `sample_rows`) broke bench/offline_step_split.py at run time, so a real compiled-decode
    engine is instrumented here (construction only: nothing compiles until a decode step)."""
    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine

    monkeypatch.syspath_prepend(str(BENCH))
    split = importlib.import_module("decode_step_split")
    model = build_model(load_preset("tiny").replace(num_hidden_layers=2, layer_types=("kda", "dsa")), seed=0).eval()
    for form in ("layers", "whole"):
        engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True, compile_form=form))
        clock = split.PhaseClock()
        split.instrument(engine, clock)
        # Each wrapped method is now the clock's wrapper, still called as the engine calls it.
        for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "forward"),
                            (engine.runner, "sample_rows"), (engine, "_postprocess")):
            assert getattr(owner, name).__qualname__.endswith("wrap.<locals>.timed"), (form, name)
