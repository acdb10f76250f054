"""One-step-ahead (async) scheduling gives the one-step engine's tokens: greedy and seeded sampling, alone
and in batches, with stop tokens, stop strings, max_tokens, penalties, aborts, preemption and prefix hits."""

from __future__ import annotations

import asyncio
import time

import pytest

from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def generate(model, prompts, params, waves=None, **config):
    """Completions (token ids, finish reason, stop reason, text) of `prompts`, sent in `waves` of slices."""
    engine = LLMEngine(model, config=EngineConfig(**config))
    out = []
    for lo, hi in waves or [(0, len(prompts))]:
        out += engine.generate(prompts[lo:hi], params if not isinstance(params, list) else params[lo:hi],
                               progress=False)
    engine.shutdown()
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out], engine


def both(model, prompts, params, waves=None, **config):
    one, sync = generate(model, prompts, params, waves, **config)
    ahead, overlapped = generate(model, prompts, params, waves, async_scheduling=True, **config)
    assert overlapped.overlap is not None and sync.overlap is None
    assert ahead == one
    for engine in (sync, overlapped):  # every block and slot back, nothing left in flight
        stats = engine.stats()
        assert (stats.block_usage, stats.slot_usage, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    assert overlapped.overlap._in_flight is None
    return one, sync, overlapped


def test_greedy_alone_and_batched_match_reference(k31_model, helpers):
    ps = helpers.prompts(12, 1, 40, seed=11)
    one, _, _ = both(k31_model, ps, GREEDY, cache_memory="16MiB")
    assert [o[0] for o in one[:3]] == [helpers.reference_greedy(k31_model, p, 8) for p in ps[:3]]
    alone, _, _ = both(k31_model, ps[:1], GREEDY, cache_memory="16MiB")
    assert alone[0] == one[0]


def test_seeded_sampling_with_stops_and_max_tokens(k31_model, helpers):
    """Stops found one step late: the speculative step's token is dropped, its memory freed."""
    ps = helpers.prompts(10, 3, 30, seed=4)
    params = [SamplingParams(max_tokens=2 + i % 6, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=[i % 5, 7],
                             logprobs=1 if i % 3 == 0 else None) for i in range(10)]
    one, _, _ = both(k31_model, ps, params, cache_memory="16MiB")
    assert {reason for _, reason, _, _ in one} == {"stop", "length"}
    # A stop string taken from a sampled text ends that request early, the same way in both.
    text = next(t for _, _, _, t in one if len(t) >= 3)
    stopped = [SamplingParams(max_tokens=8, temperature=0.9, seed=3, stop=[text[1:3]]) for _ in ps[:4]]
    both(k31_model, ps[:4], stopped, cache_memory="16MiB")


def test_preemption_and_penalties(k31_model, helpers):
    """~8 blocks for 16 requests: decodes preempt by recompute. A negative frequency penalty favours repeats,
    so a penalised request that missed its latest token (still in flight) would show it."""
    ps = helpers.prompts(16, 1, 45, seed=11)
    params = [SamplingParams(max_tokens=8, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             frequency_penalty=-2.0 if i % 4 == 0 else 0.0) for i in range(16)]
    _, sync, overlapped = both(k31_model, ps, params, cache_memory=40_000, max_num_batched_tokens=64)
    assert sync.stats().num_preemptions > 0 and overlapped.stats().num_preemptions > 0


def test_prompt_logprobs_equal_one_step_at_a_time(k31_model, helpers):
    """The device thread scores prompt chunks (planned on the host at launch) and the host adds them when
    it collects the step: over several chunks, beside plain rows, through preemption, equal to the
    one-step engine's (values to fp32 rounding: batches differ)."""
    ps = helpers.prompts(10, 20, 45, seed=31)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
              for i in range(10)]
    config = dict(cache_memory=40_000, max_num_batched_tokens=32)
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(k31_model, config=EngineConfig(**config, async_scheduling=async_scheduling))
        runs.append(engine.generate(ps, params, progress=False))
        assert engine.stats().num_preemptions > 0
        engine.shutdown()
    for a, b, p, prompt in zip(*runs, params, ps):
        assert a.token_ids == b.token_ids
        if p.prompt_logprobs is None:
            assert a.prompt_logprobs is None and b.prompt_logprobs is None
            continue
        assert [t.token_id for t in b.prompt_logprobs] == prompt[1:] == [t.token_id for t in a.prompt_logprobs]
        assert [t.logprob for t in b.prompt_logprobs] == pytest.approx([t.logprob for t in a.prompt_logprobs], abs=1e-5)
        assert [[i for i, _ in t.top] for t in b.prompt_logprobs] == [[i for i, _ in t.top] for t in a.prompt_logprobs]


def test_choices_draw_their_first_tokens_from_the_shared_prefill(k31_model, helpers):
    """n > 1: the device thread draws each waiting choice's first token from its parent's last-prompt
    logits (its own seed); the choice then computes prompt and token itself. Every choice equals the
    same request alone with its seed, and its logprobs the one-step engine's choices'."""
    prompt = helpers.prompts(1, 37, 37, seed=3)[0]
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i == 0 else 1.0, seed=10 + i,
                             logprobs=1 if i % 2 else None, prompt_logprobs=1) for i in range(4)]
    got = {}
    for async_scheduling in (False, True):
        engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", async_scheduling=async_scheduling))
        seqs = [engine.make_sequence(prompt, p, request_id=f"c{i}") for i, p in enumerate(params)]
        for child in seqs[1:]:  # as the server sends them: the choices first, naming the parent
            child.fork_of = "c0"
            engine.add_sequence(child)
        engine.add_sequence(seqs[0])
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        got[async_scheduling] = [(s.output_ids, [lp.logprob for o in outputs[s.request_id] for lp in o.delta_logprobs or []])
                                 for s in seqs]
        # every choice's first output carries the whole prompt's logprobs (copied from the parent's)
        assert [len(outputs[s.request_id][0].prompt_logprobs) for s in seqs] == [len(prompt) - 1] * 4
        stats = engine.stats()
        assert (stats.block_usage, stats.slot_usage, stats.num_running) == (0, 0, 0)
        engine.shutdown()
    alone = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB"))
    assert [tokens for tokens, _ in got[True]] == [alone.generate([prompt], p, progress=False)[0].token_ids
                                                   for p in params]
    for (a, la), (b, lb) in zip(got[True], got[False]):
        assert a == b and la == pytest.approx(lb, abs=1e-5)


def test_prefix_hits_and_snapshots(k31_model, helpers):
    heads = helpers.prompts(3, 40, 40, seed=21)
    ps = [heads[i % 3] + t for i, t in enumerate(helpers.prompts(12, 1, 12, seed=22))]
    _, sync, overlapped = both(k31_model, ps, GREEDY, waves=[(0, 3), (3, 12)], cache_memory="16MiB",
                               snapshot_interval_blocks=1)
    assert overlapped.stats().prefix_hit_tokens == sync.stats().prefix_hit_tokens > 0
    assert overlapped.stats().num_snapshots > 0


def abort_in_flight(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy requests; the first is aborted after four steps (a step is in flight with async
    scheduling); the others' streamed tokens. Every block and slot is back at the end."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(4):
        for out in engine.step():
            streamed[out.request_id] += out.delta_token_ids
    final = engine.abort(ids[0])
    assert final.finish_reason == "abort" and final.num_output_tokens == len(streamed[ids[0]])
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.delta_token_ids
    stats = engine.stats()
    assert (stats.block_usage, stats.slot_usage) == (0, 0)
    return [streamed[i] for i in ids[1:]]


def test_abort_while_a_step_is_in_flight(k31_model, helpers):
    ps = helpers.prompts(4, 10, 20, seed=5)

    def run(async_scheduling: bool):
        engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", async_scheduling=async_scheduling))
        try:
            return abort_in_flight(engine, ps)
        finally:
            engine.shutdown()

    assert run(True) == run(False)


def test_server_front_streams_and_cancels(k31_model, helpers):
    """AsyncLLMEngine (the server's engine thread) over async scheduling: the same streams, text included;
    a cancelled stream (a client gone) frees its memory."""
    ps = helpers.prompts(4, 3, 30, seed=8)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected, _ = generate(k31_model, ps, params, cache_memory="8MiB")
    engine = AsyncLLMEngine(LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", async_scheduling=True)))

    async def stream(prompt):
        return [o async for o in engine.generate(prompt, params)]

    async def cancelled():
        seen = []

        async def consume():
            async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(seen)

    async def main():
        return await asyncio.gather(cancelled(), *(stream(p) for p in ps))

    try:
        seen, *streams = asyncio.run(main())
        for _ in range(200):
            if engine.stats().num_running == 0:
                break
            time.sleep(0.01)
    finally:
        engine.shutdown()
    for outs, (tokens, reason, _, text) in zip(streams, expected):
        assert [t for o in outs for t in o.delta_token_ids] == tokens and outs[-1].finish_reason == reason
        assert "".join(o.delta_text for o in outs) == text
    stats = engine.stats()
    assert 3 <= seen < 400 and (stats.num_running, stats.block_usage, stats.slot_usage) == (0, 0.0, 0.0)


def test_requests_the_overlapped_path_cannot_serve_are_refused_naming_the_field(helpers):
    """Grammar masks need host work per token that the device thread skips: such a request is a
    RequestError at once, never served without it."""
    from deltamoe.errors import ConfigError, RequestError
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams
    from deltamoe.serve.structured.constraint import choice_constraint
    from deltamoe.model.load import build_model

    engine = LLMEngine(build_model(helpers.k31_tiny(), seed=0).eval(),
                       config=EngineConfig(cache_memory="8MiB", async_scheduling=True))
    try:
        cases = [(SamplingParams(max_tokens=2, structured=choice_constraint(["a"], "guided_choice")), None,
                  "guided_choice"),  # the field the client sent (was always response_format)
                 ]
        for params, fork_of, field in cases:
            seq = engine.make_sequence([1, 2, 3], params)
            seq.fork_of = fork_of
            with pytest.raises(RequestError) as e:
                engine.add_sequence(seq)
            assert e.value.field == field
        assert not engine.has_unfinished()
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError) as e:
        EngineConfig(async_scheduling=True, speculative="mtp")
    assert e.value.field == "async_scheduling"
