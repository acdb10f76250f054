"""The cost rule under the batch limit (`spec_batch_rule="cost"`, `spec_decode/step_costs.py`):
a batch size speculates only where its measured speculative step costs less than the plain steps
emitting the same tokens; unmeasured costs are measured first; greedy output stays plain decoding's."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.step_costs import RECHECK_AFTER, SAMPLES_TO_DECIDE, StepCosts
from deltamoe.serve.spec_decode.tracker import AcceptanceTracker


def measured(costs: StepCosts, speculative: bool, batch: int, seconds: float, n: int = SAMPLES_TO_DECIDE) -> None:
    for _ in range(n):
        costs.record(speculative, batch, seconds)


def test_decision_from_measured_costs_and_acceptance():
    costs = StepCosts()
    assert costs.speculation_pays(2, 2.0)  # nothing measured: speculate, to measure it
    measured(costs, True, 2, 0.030)
    assert not costs.speculation_pays(2, 2.0)  # the speculative step measured, the plain one not yet
    measured(costs, False, 2, 0.010)
    assert costs.speculation_pays(2, 3.1)  # 3.1 tokens x 10 ms > 30 ms
    assert not costs.speculation_pays(2, 2.9)  # 29 ms of plain steps for the same tokens: plain
    assert costs.speculation_pays(2, None)  # no verification yet: speculate
    assert costs.speculation_pays(1, 1.0)  # another batch size: its own costs, unmeasured
    costs.record(True, 2, 10.0)  # a stall (a compile) among the samples moves no median
    assert costs.cost(True, 2) == pytest.approx(0.030)
    assert costs.table() == {"spec_decode_plain_step_ms_batch_2": 10.0,
                             "spec_decode_speculative_step_ms_batch_2": 30.0}


def test_plain_decisions_recheck_the_speculative_cost():
    costs = StepCosts()
    measured(costs, True, 3, 0.030)
    measured(costs, False, 3, 0.010)
    decisions = [costs.speculation_pays(3, 1.5) for _ in range(RECHECK_AFTER)]
    assert not any(decisions[:-1])
    assert costs.cost(True, 3) is None  # forgotten: measured again
    assert costs.speculation_pays(3, 1.5)


def test_tokens_per_verification_prefers_the_rows_own_history():
    class Seq:  # the tracker keys its state by sequence object
        pass

    tracker, a, b, c = AcceptanceTracker(2, min_acceptance=0.0), Seq(), Seq(), Seq()
    assert tracker.tokens_per_verification([a]) is None
    tracker.record(a, 2)
    tracker.record(a, 2)
    tracker.record(b, 0)
    assert tracker.tokens_per_verification([a]) == 3.0
    assert tracker.tokens_per_verification([b]) == 1.0
    # c has none of its own: every verification so far (4 drafts kept of 3 verifications)
    assert tracker.tokens_per_verification([c]) == pytest.approx(1 + 4 / 3)
    assert tracker.tokens_per_verification([a, b]) == 2.0


def test_config():
    assert EngineConfig().spec_batch_rule == "cost"
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative="mtp", spec_batch_rule="sometimes")
    assert e.value.field == "spec_batch_rule"


@pytest.fixture(scope="module")
def mtp_model(helpers):
    return build_model(helpers.k31_tiny(num_nextn_predict_layers=1), seed=5).eval()


def right_drafts(runner, continuation: dict[tuple[int, ...], list[int]]) -> None:
    """The drafter's work as usual, its tokens set to the plain greedy continuation (every draft right)."""
    run = runner.drafter.run

    def drafted(rows):
        drafts = run(rows)
        for row, d in zip(rows, drafts):
            if d is not None:
                full = continuation[tuple(row.seq.token_ids[:row.seq.num_prompt_tokens])]
                d.tokens = [full[i] if i < len(full) else 0 for i in range(d.position + 1, d.position + 1 + len(d.tokens))]
        return drafts

    runner.drafter.run = drafted


@torch.inference_mode()
def test_engine_speculates_where_the_costs_say_it_pays(mtp_model, helpers):
    """Batch 2 costs more speculating (30 ms) than three plain steps (3 x 10 ms): plain there; batch 1
    speculates (12 ms against 3 x 10 ms). Output equals plain decoding's."""
    pa, pb = helpers.prompts(2, 5, 9, seed=31)
    eng = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=2,
                                                   spec_min_acceptance=0.0, spec_max_batch=4, block_size=4))
    runner, tracker = eng.runner, eng.runner.tracker
    ref = {tuple(p): p + helpers.reference_greedy(mtp_model, p, 30) for p in (pa, pb)}
    right_drafts(runner, ref)
    measured(runner.costs, True, 1, 0.012)
    measured(runner.costs, False, 1, 0.010)
    measured(runner.costs, True, 2, 0.030)
    measured(runner.costs, False, 2, 0.010)
    runner.costs.record = lambda *args: None  # the table above decides, whatever this machine's steps take
    a = eng.make_sequence(pa, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    b = eng.make_sequence(pb, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    eng.add_sequence(a)
    eng.add_sequence(b)
    while not (a.output_ids and b.output_ids):  # the prefills
        eng.step()
    eng.step()  # the first decode step: nothing verified yet, so both verify (acceptance is measured)
    assert tracker.verifications == 2
    while not b.finished:
        eng.step()
    assert tracker.plain_by_cost_steps >= 5  # batch 2: plain by cost from then on
    assert tracker.verifications == 2
    before = tracker.verifications
    while eng.has_unfinished():
        eng.step()
    assert tracker.verifications > before  # batch 1: speculates, every draft kept
    assert tracker.acceptance_rates() == [1.0, 1.0]
    assert a.output_ids == ref[tuple(pa)][len(pa):]
    assert b.output_ids == ref[tuple(pb)][len(pb):12 + len(pb)]
    extra = eng.stats().extra
    assert extra["spec_decode_plain_by_cost_steps"] == tracker.plain_by_cost_steps
    assert extra["spec_decode_speculative_step_ms_batch_2"] == 30.0


@torch.inference_mode()
def test_seeded_sampling_ignores_the_cost_rule(mtp_model, helpers):
    """A seeded sampling request's text must not depend on timings: whatever the measured costs say
    at batch 2, a step holding a seeded sampling row speculates (plain and speculative steps draw
    from the generator differently), so two engines whose cost tables disagree write the same text.
    An unseeded sampling row next to a greedy one still follows the costs."""
    pa, pb = helpers.prompts(2, 5, 9, seed=32)

    def run(plain_step_seconds: float, seed: int | None) -> tuple[list[int], list[int], int]:
        eng = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=2,
                                                       spec_min_acceptance=0.0, spec_max_batch=4, block_size=4))
        runner = eng.runner
        measured(runner.costs, True, 2, 0.030)
        measured(runner.costs, False, 2, plain_step_seconds)
        runner.costs.record = lambda *args: None
        a = eng.make_sequence(pa, SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True))
        b = eng.make_sequence(pb, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        eng.add_sequence(a)
        eng.add_sequence(b)
        while eng.has_unfinished():
            eng.step()
        return a.output_ids, b.output_ids, runner.tracker.plain_by_cost_steps

    cheap_plain = run(0.001, seed=7)  # the costs say plain at batch 2
    dear_plain = run(1.0, seed=7)  # they say speculate
    assert cheap_plain[2] == dear_plain[2] == 0
    assert cheap_plain[:2] == dear_plain[:2]
    assert run(0.001, seed=None)[2] > 0  # unseeded: the costs decide
