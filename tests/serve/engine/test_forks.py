"""n > 1 choices share one prefill: each choice forks the first one's cache and gets exactly the
tokens it would get as a request of its own with the same seed."""

from __future__ import annotations

import pytest

from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.structured.constraint import choice_constraint


def run_choices(engine: LLMEngine, prompt, params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    """The choices as the server sends them (children first, naming the parent); tokens computed."""
    seqs = [engine.make_sequence(prompt, p, request_id=f"c{i}") for i, p in enumerate(params)]
    for child in seqs[1:]:
        child.fork_of = "c0"
        engine.add_sequence(child)
    engine.add_sequence(seqs[0])
    computed = 0
    execute = engine.executor.execute

    def counting(batch):
        nonlocal computed
        computed += batch.num_tokens
        return execute(batch)

    engine.executor.execute = counting
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.executor.execute = execute
    return [s.output_ids for s in seqs], computed


@pytest.mark.parametrize("block_aligned", [False, True])
def test_choices_equal_separate_requests_with_one_prefill(k31_model, helpers, block_aligned):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", enable_prefix_caching=False))
    prompt = helpers.prompts(1, 32, 32, seed=3)[0] if block_aligned else helpers.prompts(1, 37, 37, seed=3)[0]
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i == 0 else 1.0, seed=10 + i) for i in range(4)]
    choices, computed = run_choices(engine, prompt, params)
    alone = [engine.generate([prompt], p, progress=False)[0].token_ids for p in params]
    assert choices == alone
    # One prompt prefill, then each choice's decodes (its first token came from the shared prefill).
    assert computed == len(prompt) + sum(len(c) - 1 for c in choices)
    stats = engine.stats()
    assert stats.block_usage == 0 and stats.slot_usage == 0


def test_a_fork_keeps_its_own_grammar_and_falls_back_without_room(k31_model, helpers):
    """Choices under a grammar each follow their own matcher; with max_num_seqs=1 no fork fits, so
    the others prefill on their own, with the same tokens."""
    prompt = helpers.prompts(1, 20, 20, seed=4)[0]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, structured=choice_constraint(["ab", "cde"], "n"))
              for i in range(3)]
    tight = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", max_num_seqs=1))
    roomy = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB"))
    (a, computed_tight), (b, computed_roomy) = run_choices(tight, prompt, params), run_choices(roomy, prompt, params)
    assert a == b and all(bytes(t).decode() in ("ab", "cde") for t in a)
    assert computed_roomy < computed_tight


def test_abort_of_a_waiting_choice_and_of_the_parent(k31_model, helpers):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB"))
    prompt = helpers.prompts(1, 20, 20, seed=5)[0]
    seqs = [engine.make_sequence(prompt, SamplingParams(max_tokens=4, seed=i), request_id=f"p{i}") for i in range(3)]
    for child in seqs[1:]:
        child.fork_of = "p0"
        engine.add_sequence(child)
    assert engine.abort("p1").finish_reason == "abort"  # waiting for a parent that has not come yet
    engine.add_sequence(seqs[0])
    assert engine.abort("p0").finish_reason == "abort"  # its remaining choice now runs on its own
    while engine.has_unfinished():
        engine.step()
    assert seqs[2].finish_reason == "length" and len(seqs[2].output_ids) == 4 and not seqs[1].output_ids
    assert engine.stats().block_usage == 0 and engine.stats().slot_usage == 0
