"""Contract 5: batching never changes results. The engine's greedy tokens equal plain greedy decoding
of each prompt alone (ContiguousCache), in a batch of 64, with prefix-cache hits, and under preemption."""

from __future__ import annotations

import pytest
import torch

from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def batch64(helpers):
    """64 prompts of 1..45 tokens (several shorter than one block)."""
    return helpers.prompts(64, 1, 45, seed=11)


@pytest.fixture(scope="module")
def expected64(k31_model, batch64, helpers):
    return [helpers.reference_greedy(k31_model, p, MAX_TOKENS) for p in batch64]


def run(model, ps, **config):
    engine = LLMEngine(model, config=EngineConfig(**config))
    return engine, [c.token_ids for c in engine.generate(ps, GREEDY, progress=False)]


def test_alone_matches_reference(kimi_linear_model, helpers):
    """Kimi Linear member (softplus gate, plain residual, dense MLA); each prompt alone in the engine."""
    for p in helpers.prompts(4, 1, 40, seed=3):
        _, out = run(kimi_linear_model, [p], cache_memory="8MiB")
        assert out[0] == helpers.reference_greedy(kimi_linear_model, p, MAX_TOKENS)


def test_batch_of_64_matches_alone(k31_model, batch64, expected64):
    engine, out = run(k31_model, batch64, cache_memory="32MiB", max_num_batched_tokens=256, enable_prefix_caching=False)
    assert out == expected64
    assert engine.stats().num_preemptions == 0


def test_prefix_cache_hits_keep_results(k31_model, helpers):
    """Three shared 'system prompts' (40 tokens); the second wave reuses their blocks and KDA snapshots."""
    heads = helpers.prompts(3, 40, 40, seed=21)
    tails = helpers.prompts(24, 1, 12, seed=22)
    ps = [heads[i % 3] + t for i, t in enumerate(tails)]
    expected = [helpers.reference_greedy(k31_model, p, MAX_TOKENS) for p in ps]
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", snapshot_interval_blocks=1))
    first = [c.token_ids for c in engine.generate(ps[:3], GREEDY, progress=False)]
    rest = engine.generate(ps[3:], GREEDY, progress=False)
    assert first + [c.token_ids for c in rest] == expected
    stats = engine.stats()
    assert stats.prefix_hit_rate > 0.3 and stats.num_snapshots > 0
    assert all(c.num_cached_tokens == 32 for c in rest)  # 2 full blocks of the 40-token head


def test_preemption_keeps_results(k31_model, batch64, expected64):
    """A cache of ~8 blocks for 64 requests: decodes run out of blocks and preempt by recompute."""
    engine, out = run(k31_model, batch64, cache_memory=40_000, max_num_batched_tokens=64)
    assert engine.cache.capacity.num_blocks <= 10
    assert engine.stats().num_preemptions > 0
    assert out == expected64
    assert engine.stats().block_usage == 0 and engine.stats().slot_usage == 0


def test_abort_frees_blocks_and_slots(k31_model, helpers):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", max_num_batched_tokens=32))
    ids = [engine.add_request(p, GREEDY) for p in helpers.prompts(6, 20, 40, seed=5)]
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.num_running > 0 and stats.block_usage > 0 and stats.slot_usage > 0
    finals = [engine.abort(i) for i in ids]
    assert all(f.finished and f.finish_reason == "abort" for f in finals)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.block_usage, stats.slot_usage) == (0, 0, 0.0, 0.0)
    assert not engine.has_unfinished() and engine.abort(ids[0]) is None


def test_priority_runs_urgent_first(k31_model):
    """With one running slot, the lower priority value is admitted first."""
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", max_num_seqs=1))
    late = engine.add_request([1, 2, 3], GREEDY, request_id="late", priority=5)
    urgent = engine.add_request([4, 5, 6], GREEDY, request_id="urgent", priority=-1)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [urgent, late]


def test_bad_requests_name_the_field(k31_model):
    from deltamoe.errors import RequestError

    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", max_model_len=64))
    cases = {
        "prompt": ([], GREEDY),
        "max_tokens": ([1] * 60, SamplingParams(max_tokens=10)),
        "temperature": ([1], SamplingParams(temperature=-1)),
        "top_p": ([1], SamplingParams(top_p=0)),
        "stop_token_ids": ([1], SamplingParams(stop_token_ids=[10_000])),
        "logprobs": ([1], SamplingParams(logprobs=50)),
    }
    for field, (prompt, params) in cases.items():
        with pytest.raises(RequestError) as e:
            engine.add_request(prompt, params)
        assert e.value.field == field
    with pytest.raises(RequestError) as e:
        engine.add_request([999], GREEDY)
    assert e.value.field == "prompt"
    engine.add_request([1], GREEDY, request_id="x")
    with pytest.raises(RequestError) as e:
        engine.add_request([1], GREEDY, request_id="x")
    assert e.value.field == "request_id"


def test_eos_and_stop_token_end_generation(k31_model, helpers):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    p = helpers.prompts(1, 5, 5, seed=9)[0]
    first = helpers.reference_greedy(k31_model, p, 3)
    out = engine.generate([p], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first[1]]), progress=False)[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop" and out.stop_reason == first[1]


def test_stats_count_tokens(k31_model):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    engine.generate([[1, 2, 3], [4, 5]], GREEDY, progress=False)
    s = engine.stats()
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.requests_finished) == (5, 2 * MAX_TOKENS, 2)
    assert torch.isfinite(torch.tensor(s.prefix_hit_rate))
