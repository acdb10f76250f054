"""Multi-step decode (`EngineConfig.num_scheduler_steps`) gives the one-step engine's tokens: greedy and
seeded sampling, requests finishing inside a window (stop tokens, stop strings, max_tokens), preemption,
prefix hits with KDA snapshots; rows that need host work per token run one step at a time."""

from __future__ import annotations

import pytest

from deltamoe.errors import ConfigError
from deltamoe.serve.engine import llm_engine, multi_step, multi_step_layouts
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.step_result import emit_speculative

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def both(model, prompts, params, steps=4, **config):
    """The completions (token ids, finish reason, stop reason, text) of one step at a time and of windows of
    `steps`, asserted equal, and the two engines; every block and slot is back in both."""
    runs = []
    for n in (1, steps):
        engine = LLMEngine(model, config=EngineConfig(num_scheduler_steps=n, **config))
        out = engine.generate(prompts, params, progress=False)
        stats = engine.stats()
        assert (stats.block_usage, stats.slot_usage, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
        runs.append(([(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out], engine))
    (one, single), (many, windowed) = runs
    assert single.multi_step is None and windowed.multi_step.windows > 0  # windows really ran
    assert many == one
    return one, single, windowed


def test_greedy_alone_and_batched_match_reference(k31_model, helpers):
    ps = helpers.prompts(10, 1, 40, seed=11)
    one, single, windowed = both(k31_model, ps, GREEDY, cache_memory="16MiB")
    assert [o[0] for o in one[:3]] == [helpers.reference_greedy(k31_model, p, 12) for p in ps[:3]]
    assert windowed.stats().steps < single.stats().steps  # fewer trips through the scheduler
    # max_tokens 12: the first token comes from the prefill, then windows of 4, 4 and 3 steps.
    assert windowed.multi_step.window_steps >= 8


def test_seeded_sampling_with_stops_inside_windows(k31_model, helpers):
    """Stop tokens, stop strings and different max_tokens end requests inside a window: the tokens
    sampled after the finish are dropped and the memory goes back."""
    ps = helpers.prompts(10, 3, 30, seed=4)
    params = [SamplingParams(max_tokens=3 + i % 9, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=[i % 5, 7])
              for i in range(10)]
    one, _, _ = both(k31_model, ps, params, steps=8, cache_memory="16MiB")
    assert {reason for _, reason, _, _ in one} == {"stop", "length"}
    text = next(t for _, _, _, t in one if len(t) >= 3)
    stopped = [SamplingParams(max_tokens=10, temperature=0.9, seed=3, stop=[text[1:3]]) for _ in ps[:4]]
    both(k31_model, ps[:4], stopped, steps=8, cache_memory="16MiB")


def test_preemption_and_rows_that_need_host_work(k31_model, helpers):
    """~8 blocks for 16 requests: decodes preempt by recompute, and windows that do not fit run as one
    step. Penalised and logprob rows need host work per token: their batches go one step at a time."""
    ps = helpers.prompts(16, 1, 45, seed=11)
    params = [SamplingParams(max_tokens=10, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             frequency_penalty=-2.0 if i == 5 else 0.0, logprobs=1 if i == 9 else None)
              for i in range(16)]
    _, single, windowed = both(k31_model, ps, params, cache_memory=40_000, max_num_batched_tokens=64)
    assert single.stats().num_preemptions > 0 and windowed.stats().num_preemptions > 0


def test_prefix_hits_and_snapshots(kimi_linear_model, helpers):
    """Snapshots every block (16 tokens): a window ends at each boundary, so the snapshot holds the KDA
    state there. The second wave continues the first wave's conversations (prompt + output + more), so
    its prompts hit the snapshots taken while decoding."""
    firsts = helpers.prompts(3, 37, 43, seed=21)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(steps: int):
        engine = LLMEngine(kimi_linear_model, config=EngineConfig(
            cache_memory="16MiB", snapshot_interval_blocks=1, num_scheduler_steps=steps))
        first = engine.generate(firsts, params, progress=False)
        follow = [p + c.token_ids + t for p, c, t in zip(firsts, first, helpers.prompts(3, 1, 9, seed=22))]
        second = engine.generate(follow, params, progress=False)
        return [c.token_ids for c in first + second], engine.stats()

    one, single = run(1)
    many, windowed = run(8)
    assert many == one
    assert windowed.prefix_hit_tokens == single.prefix_hit_tokens >= 3 * 64  # past the prompts: decoded blocks
    assert windowed.num_snapshots == single.num_snapshots > 0


def test_streams_in_bursts_with_the_first_token_alone(k31_model, helpers):
    """A request's first token comes from its prefill step alone; later outputs carry up to N tokens."""
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", num_scheduler_steps=4))
    rid = engine.add_request(helpers.prompts(1, 5, 5, seed=1)[0], GREEDY)
    bursts = []
    while engine.has_unfinished():
        bursts += [len(o.delta_token_ids) for o in engine.step() if o.request_id == rid]
    assert bursts == [1, 4, 4, 3]


def test_refused_where_it_cannot_run_yet(k31_model):
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError) as e:
            EngineConfig(num_scheduler_steps=bad)
        assert e.value.field == "num_scheduler_steps"
    for other in ({"async_scheduling": True}, {"speculative": "mtp"}):
        with pytest.raises(ConfigError) as e:
            EngineConfig(num_scheduler_steps=4, **other)
        assert e.value.field == "num_scheduler_steps"
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    for workers, transfers in ((True, False), (False, True)):
        with pytest.raises(ConfigError, match="not yet") as e:
            multi_step.multi_step_decode(engine.runner, engine.cache, EngineConfig(num_scheduler_steps=2),
                                         workers, transfers)
        assert e.value.field == "num_scheduler_steps"


def test_cli_flag(k31_model, tmp_path, capsys):
    """`generate --num-scheduler-steps 4`, and generate's default, print what one step at a time prints; a
    bad value, or workers and roles it cannot run with, exit 2 naming the field before anything loads."""
    from deltamoe.cli import main
    from deltamoe.model.weights import save_checkpoint

    save_checkpoint(k31_model, tmp_path)
    args = ["generate", str(tmp_path), "-p", "hello", "-p", "hi there", "--max-tokens", "9", "--temperature", "0",
            "--ignore-eos", "--no-compile"]
    assert main([*args, "--num-scheduler-steps", "1"]) == 0
    one = capsys.readouterr().out
    for steps in (["--num-scheduler-steps", "4"], []):
        assert main([*args, *steps]) == 0
        assert capsys.readouterr().out == one
    for bad in (["generate", str(tmp_path), "-p", "x", "--num-scheduler-steps", "0"],
                ["generate", str(tmp_path), "-p", "x", "--num-scheduler-steps", "4", "--tp", "2", "--no-compile"],
                ["serve", str(tmp_path), "--num-scheduler-steps", "4", "--role", "prefill", "--kv-transfer",
                 "mooncake"]):
        assert main(bad) == 2
        assert "num_scheduler_steps" in capsys.readouterr().err


def test_generate_default_windows_only_where_they_run():
    assert multi_step_layouts.resolve_generate_steps(None, False, False, False) == \
        multi_step_layouts.GENERATE_DEFAULT_STEPS > 1
    for workers, async_scheduling, speculative in ((True, False, False), (False, True, False), (False, False, True)):
        assert multi_step_layouts.resolve_generate_steps(None, workers, async_scheduling, speculative) == 1
    assert multi_step_layouts.resolve_generate_steps(3, False, False, False) == 3


def test_window_emission_equals_token_by_token(k31_model, helpers, monkeypatch):
    """A window's row without a snapshot inside is emitted at once (`multi_step.emit_window`): every
    output (deltas, finish, stop reason, counts), every published block and snapshot must be what
    handing its tokens over one at a time (`emit_speculative`, the engine's path before) gives, with stop
    tokens, stop strings and max_tokens ending rows inside windows."""
    ps = helpers.prompts(8, 3, 30, seed=5)
    text = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB")).generate(
        ps[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), progress=False)[0].text
    params = [SamplingParams(max_tokens=20 + i, temperature=0.9, seed=i, stop_token_ids=[i % 7],
                             stop=[text[2:4]] if i % 2 else []) for i in range(8)]

    def run(one_by_one: bool):
        engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", block_size=4, num_scheduler_steps=8))
        if one_by_one:  # every row token by token, as rows with a snapshot inside still go
            monkeypatch.setattr(llm_engine, "emit_window", lambda take, cache, r: emit_speculative(engine._postprocess, r))
        for p, sp in zip(ps, params):
            engine.add_request(p, sp)
        outputs = []
        while engine.has_unfinished():
            outputs += [(o.request_id, o.delta_text, o.delta_token_ids, o.text, o.finished, o.finish_reason,
                         o.stop_reason, o.num_output_tokens) for o in engine.step()]
        return outputs, list(engine.cache.blocks.hashes), engine.stats().num_snapshots, engine.multi_step.windows

    at_once, one_by_one = run(False), run(True)
    assert at_once == one_by_one
    assert at_once[3] > 0 and any(len(o[2]) > 1 for o in at_once[0])  # windows ran, several tokens an output
    assert {o[5] for o in at_once[0] if o[4]} >= {"stop"}
