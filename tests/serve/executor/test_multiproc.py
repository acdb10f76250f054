"""Distributed serving equals one process: tp2, ep2 (and tp2 x ep2, slow) on gloo give the single-process
engine's tokens, greedy and seeded sampling, through prefix-cache hits and preemption, eagerly and with
the decode step compiled on every rank; a dead worker is an error at once, never a hang, and shutdown
leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.metrics import ServerMetrics
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.base import WorkerDiedError
from deltamoe.serve.executor.config import WorkerConfig


def engine_config(**compiled) -> EngineConfig:
    # Small enough that four running sequences run out of blocks (preemption by recompute); one
    # snapshot per block, so requests sharing a prefix hit the cache.
    return EngineConfig(cache_memory=40_000, max_num_seqs=4, max_num_batched_tokens=64, snapshot_interval_blocks=1,
                        **compiled)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, helpers):
    path = tmp_path_factory.mktemp("ckpt") / "k31-tiny"
    save_checkpoint(build_model(helpers.k31_tiny(), seed=3).eval(), path)
    return str(path)


@pytest.fixture(scope="module")
def workload(helpers):
    prefix = helpers.prompts(1, 32, 32, seed=11)[0]
    prompts = helpers.prompts(8, 18, 40, seed=12, prefix=prefix)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_k=40, seed=100 + i)
              for i in range(len(prompts))]
    return prompts, params


def run(engine: LLMEngine, workload) -> list[list[int]]:
    prompts, params = workload
    first = engine.generate(prompts[:1], params[:1], progress=False)  # its prefix is then cached
    rest = engine.generate(prompts[1:], params[1:], progress=False)
    return [c.token_ids for c in first + rest]


@pytest.fixture(scope="module")
def expected(checkpoint, workload):
    return run(LLMEngine.from_pretrained(checkpoint, engine_config()), workload)


def check_layout(checkpoint, workload, expected, tp: int, ep: int, **compiled) -> None:
    engine = LLMEngine.from_pretrained(checkpoint, engine_config(**compiled), workers=WorkerConfig(tp=tp, ep=ep))
    try:
        assert engine.runner.compiles_decode == bool(compiled)
        assert run(engine, workload) == expected
        stats = engine.stats()
        assert stats.prefix_hit_tokens > 0 and stats.num_preemptions > 0
        check_rank_metrics(engine, tp, ep)
        check_forget_stats(engine)
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)


def check_forget_stats(engine: LLMEngine) -> None:
    """After `forget_stats` (what a warm-up ends with) every rank counts afresh: the other ranks reset
    theirs with the next step's message, which also gathers them."""
    engine.executor.forget_stats()
    assert all(r.steps == 0 and r.forward_seconds_total == 0 for r in engine.executor.rank_stats())
    assert not engine.runner.expert_load.any()
    before = engine.stats().steps
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    reports, steps = engine.executor.rank_stats(), engine.stats().steps - before
    assert reports[0].steps == steps and all(1 <= r.steps <= steps for r in reports[1:])
    assert engine.runner.expert_load.sum() > 0


def check_rank_metrics(engine: LLMEngine, tp: int, ep: int) -> None:
    reports = engine.executor.rank_stats()
    assert [r.rank for r in reports] == list(range(tp * ep)) and reports[0].steps == engine.stats().steps
    assert all(r.steps > 0 and r.forward_seconds_total > 0 for r in reports)
    # Rank r holds experts [r // tp * E/ep, ...): the slices of one TP rank per expert group tile the load.
    whole = [sum((reports[g * tp].expert_tokens[layer] for g in range(ep)), []) for layer in range(len(
        reports[0].expert_tokens))]
    assert whole == engine.runner.expert_load.tolist()
    per_layer = [sum(row) for row in whole]
    assert per_layer[0] > 0 and len(set(per_layer)) == 1  # every MoE layer routes the same tokens
    text = ServerMetrics(engine.stats, engine.executor.rank_stats).render().decode()
    assert f'deltamoe_rank_step_seconds{{rank="{tp * ep - 1}"}}' in text
    assert f'deltamoe_expert_tokens_total{{expert="0",layer="0",rank="0"}} {float(whole[0][0])}' in text
    exported = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("deltamoe_expert_tokens_total{")]
    assert sum(exported) == sum(per_layer)  # each expert once, whatever the TP degree
    assert ('deltamoe_expert_imbalance{layer="0",placement="planned"}' in text) == (ep > 1)


def test_tp2_equals_one_process(checkpoint, workload, expected):
    check_layout(checkpoint, workload, expected, tp=2, ep=1)


def test_ep2_equals_one_process(checkpoint, workload, expected):
    check_layout(checkpoint, workload, expected, tp=1, ep=2)


@pytest.mark.slow
def test_tp2_ep2_equals_one_process(checkpoint, workload, expected):
    check_layout(checkpoint, workload, expected, tp=2, ep=2)


def test_compiled_tp2_equals_one_process(checkpoint, workload, expected):
    """Every rank compiles the same regions; the row-parallel all-reduces and the vocabulary all-gather
    run inside the graphs (torch's functional collectives over gloo)."""
    check_layout(checkpoint, workload, expected, tp=2, ep=1, compile_decode=True)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["layers", "parts"])
def test_compiled_ep2_equals_one_process(checkpoint, workload, expected, form):
    """The expert-parallel dispatch (all-to-all sizes from the routing) runs eagerly between two graphs."""
    check_layout(checkpoint, workload, expected, tp=1, ep=2, compile_decode=True, compile_form=form)


def test_dead_worker_is_an_error_not_a_hang(checkpoint):
    engine = LLMEngine.from_pretrained(checkpoint, engine_config(), workers=WorkerConfig(ep=2))
    try:
        worker = engine.executor.group.processes[0]
        # Ctrl-C or a SIGTERM to the process group reach the workers too: rank 0 decides when they stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.pid, sig)
        time.sleep(0.5)
        assert worker.poll() is None and engine.executor.healthy
        os.kill(worker.pid, signal.SIGKILL)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
        start = time.monotonic()
        # The dead rank is named, whether the watchdog or the broken collective noticed first.
        with pytest.raises(WorkerDiedError, match="worker rank 1 exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerDiedError):  # and every later step, at once
            engine.executor.check_health()
        assert not engine.executor.healthy
        assert engine.executor.unhealthy_reason == "the model workers are down: worker rank 1 exited with code -9"
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)


def test_layout_that_does_not_fit_the_model_names_the_field(checkpoint):
    for workers, field in [(WorkerConfig(tp=3), "tp"), (WorkerConfig(ep=3), "ep"), (WorkerConfig(tp=0), "tp")]:
        with pytest.raises(ConfigError) as error:
            LLMEngine.from_pretrained(checkpoint, engine_config(), workers=workers)
        assert error.value.field == field
    with pytest.raises(ConfigError) as error:  # before any rank starts
        LLMEngine.from_pretrained(checkpoint, engine_config(compile_decode=True, compile_form="whole"),
                                  workers=WorkerConfig(tp=2))
    assert error.value.field == "compile_form"
