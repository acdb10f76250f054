"""One-step-ahead scheduling over tp * ep worker ranks (gloo, spawned workers) gives the one-process,
one-step engine's tokens: greedy and seeded sampling through prefix hits and preemption, stop
tokens and stop strings found one step late, and a request aborted while a step is in flight.
A rank that dies while steps are in flight is an error, never a hang. tp2 runs in the default suite;
ep2 and the dead rank behind `-m slow`."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.base import WorkerDiedError
from deltamoe.serve.executor.config import WorkerConfig
from tests.serve.executor.test_multiproc import checkpoint, engine_config, run, workload  # noqa: F401
from tests.serve.executor.test_overlap import GREEDY, abort_in_flight


def stops(engine: LLMEngine, helpers) -> list[tuple]:
    """Seeded requests ending on stop tokens and max_tokens, then on a stop string from a sampled text."""
    ps = helpers.prompts(6, 3, 30, seed=4)
    params = [SamplingParams(max_tokens=2 + i % 6, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=[i % 5, 7],
                             logprobs=1 if i % 3 == 0 else None) for i in range(6)]
    first = [(c.token_ids, c.finish_reason, c.text) for c in engine.generate(ps, params, progress=False)]
    text = max((t for _, _, t in first), key=len)
    stopped = [SamplingParams(max_tokens=8, temperature=0.9, seed=3, stop=[text[1:3]]) for _ in ps[:4]]
    return first + [(c.token_ids, c.finish_reason, c.text) for c in engine.generate(ps[:4], stopped, progress=False)]


def scenarios(engine: LLMEngine, workload, helpers) -> tuple:
    out = (run(engine, workload), stops(engine, helpers), abort_in_flight(engine, helpers.prompts(4, 10, 20, seed=5)))
    stats = engine.stats()
    assert (stats.block_usage, stats.slot_usage, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    return out, stats


@pytest.fixture(scope="module")
def one_process(checkpoint, workload, helpers):  # noqa: F811
    engine = LLMEngine.from_pretrained(checkpoint, engine_config())
    try:
        return scenarios(engine, workload, helpers)[0]
    finally:
        engine.shutdown()


def check_async_layout(checkpoint, workload, one_process, helpers, tp: int, ep: int) -> None:  # noqa: F811
    config = dataclasses.replace(engine_config(), async_scheduling=True)
    engine = LLMEngine.from_pretrained(checkpoint, config, workers=WorkerConfig(tp=tp, ep=ep))
    try:
        assert engine.overlap is not None and engine.executor.group.world_size == tp * ep
        got, stats = scenarios(engine, workload, helpers)
        assert got == one_process
        assert stats.prefix_hit_tokens > 0 and stats.num_preemptions > 0
        assert engine.overlap._in_flight is None
        reports = engine.executor.rank_stats()
        assert [r.rank for r in reports] == list(range(tp * ep)) and all(r.steps > 0 for r in reports)
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)


def test_tp2_async_equals_one_process(checkpoint, workload, one_process, helpers):  # noqa: F811
    """tp2 in the default suite: each rank computes its heads of every row, so a rank that filled a
    placeholder wrongly changes the tokens (with ep2 a rank's rows reach the logits only through the
    tiny model's small expert outputs)."""
    check_async_layout(checkpoint, workload, one_process, helpers, tp=2, ep=1)


@pytest.mark.slow
def test_ep2_async_equals_one_process(checkpoint, workload, one_process, helpers):  # noqa: F811
    check_async_layout(checkpoint, workload, one_process, helpers, tp=1, ep=2)


@pytest.mark.slow
def test_dead_worker_with_async_scheduling_is_an_error_not_a_hang(checkpoint):  # noqa: F811
    """The device thread's step fails when a rank dies; the error reaches `step()` (a 503 in a server)."""
    config = dataclasses.replace(engine_config(), async_scheduling=True)
    engine = LLMEngine.from_pretrained(checkpoint, config, workers=WorkerConfig(ep=2))
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=64, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.group.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker|workers"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30 and not engine.executor.healthy
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)
