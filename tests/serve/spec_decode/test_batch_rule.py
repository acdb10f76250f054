"""The batch-size rule (`spec_max_batch`): steps at the limit run plainly, drafting resumes when the
batch shrinks with the MTP layer caught up over the plain steps' positions, greedy output unchanged.
The same catch-up lets a request switched off by low acceptance try again after a wait."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.serve.api.metrics import ServerMetrics
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.batch_rule import runs_plain
from deltamoe.serve.spec_decode.tracker import RETRY_AFTER, WINDOW, AcceptanceTracker, summary_line


@pytest.fixture(scope="module")
def mtp_model(helpers):
    return build_model(helpers.k31_tiny(num_nextn_predict_layers=1), seed=5).eval()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_rule():
    assert not runs_plain(3, 4) and runs_plain(4, 4) and runs_plain(9, 4)
    assert not runs_plain(64, 0)  # 0: speculate at any batch size
    assert EngineConfig().spec_max_batch == 4
    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigError) as e:
            EngineConfig(speculative="mtp", spec_max_batch=bad)
        assert e.value.field == "spec_max_batch"
    with pytest.raises(ConfigError) as e:  # the whole-call graph returns no hidden states for the catch-up
        EngineConfig(speculative="mtp", compile_decode=True, compile_form="whole")
    assert e.value.field == "compile_form"
    EngineConfig(speculative="mtp", compile_decode=True, compile_form="whole", spec_max_batch=0)


@torch.inference_mode()
def mtp_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The MTP head's logits for the token after the last of `token_ids`, as training computes them
    over the whole sequence (h_i and token i+1 -> token i+2)."""
    ids = torch.tensor([token_ids])
    inner, mtp = model.model, model.model.mtp_layers[0]
    out = mtp(inner(ids)[:, :-1], inner.embed_tokens(ids[:, 1:]))
    return mtp.logits(out[0, -1])


def run_crossing(eng: LLMEngine, model, pa: list[int], pb: list[int], atol: float) -> tuple:
    """`a` speculates alone, `b` joins (batch 2: the limit) and finishes, `a` drafts again. `atol`: how
    close its first draft's logits come to the whole-sequence MTP pass (missing MTP latents at the
    plainly computed positions move them by ~5e-5 in this model)."""
    tracker = eng.runner.tracker
    a = eng.make_sequence(pa, greedy(36))
    eng.add_sequence(a)
    while len(a.output_ids) < 5:
        eng.step()
    alone = tracker.verifications
    assert alone > 0 and tracker.plain_by_rule_steps == 0
    b = eng.make_sequence(pb, greedy(10))
    eng.add_sequence(b)
    while not b.finished:
        eng.step()
    assert tracker.verifications == alone and tracker.plain_by_rule_steps >= 10  # no drafts at the limit
    assert tracker.state(a).pending.length > 0  # positions since a block last filled wait for the MTP layer
    picked: list[torch.Tensor] = []  # the logits each draft is picked from
    pick = eng.runner.drafter._pick
    eng.runner.drafter._pick = lambda logits, seqs: picked.append(logits[0].clone()) or pick(logits, seqs)
    eng.step()  # a alone again: one plain token, then the MTP layer over every position since it last drafted
    eng.runner.drafter._pick = pick
    drafts = tracker.state(a).drafts
    assert drafts is not None and drafts.position == len(a.token_ids) - 1
    # Equal to the whole-sequence MTP pass: its latents at the plainly computed positions are in the cache.
    torch.testing.assert_close(picked[0], mtp_logits(model, a.token_ids), atol=atol, rtol=0)
    while eng.has_unfinished():
        eng.step()
    assert tracker.verifications > alone
    return a, b


def test_greedy_equals_plain_across_the_limit_and_drafting_resumes(mtp_model, helpers):
    pa, pb = helpers.prompts(2, 5, 9, seed=21)
    eng = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=2,
                                                   spec_min_acceptance=0.0, spec_max_batch=2, block_size=4,
                                                   spec_batch_rule="size"))
    a, b = run_crossing(eng, mtp_model, pa, pb, atol=1e-6)
    assert a.output_ids == helpers.reference_greedy(mtp_model, pa, 36)
    assert b.output_ids == helpers.reference_greedy(mtp_model, pb, 10)
    extra = eng.stats().extra
    assert extra["spec_decode_plain_by_rule_steps"] == eng.runner.tracker.plain_by_rule_steps
    text = ServerMetrics(eng.stats).render().decode()
    assert f"deltamoe_engine_spec_decode_plain_by_rule_steps_total {extra['spec_decode_plain_by_rule_steps']}" in text
    assert f"{eng.runner.tracker.plain_by_rule_steps} steps ran plain by the batch-size rule" in summary_line(
        eng.runner.tracker)


@pytest.mark.slow
def test_compiled_plain_steps_keep_the_drafter_current(mtp_model, helpers):
    """With --compile the steps at the limit run the compiled regions, which hand back the hidden
    states the MTP layer catches up over."""
    from deltamoe.serve.engine.compiled_decode import compiler_available

    if not compiler_available():
        pytest.skip("no C++ compiler for torch.compile's CPU kernels")
    pa, pb = helpers.prompts(2, 5, 9, seed=21)
    eng = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=2,
                                                   spec_min_acceptance=0.0, spec_max_batch=2, block_size=4,
                                                   compile_decode=True, spec_batch_rule="size"))
    a, b = run_crossing(eng, mtp_model, pa, pb, atol=1e-5)
    assert a.output_ids == helpers.reference_greedy(mtp_model, pa, 36)
    assert b.output_ids == helpers.reference_greedy(mtp_model, pb, 10)


def test_a_switched_off_request_tries_again_after_a_doubling_wait():
    class Seq:  # the tracker keys its state by sequence object
        grammar, params = None, SamplingParams()

    tracker, seq = AcceptanceTracker(2, min_acceptance=0.5), Seq()
    waits = []
    for _ in range(3):
        for _ in range(WINDOW):
            tracker.record(seq, 0)
        assert not tracker.speculates(seq)
        plain = 0
        while not tracker.speculates(seq):
            tracker.count_plain(seq, 1)
            plain += 1
        waits.append(plain)
    assert waits == [RETRY_AFTER, 2 * RETRY_AFTER, 4 * RETRY_AFTER]
    assert tracker.switched_off == 3 and tracker.retries == 3


def test_retry_drafts_over_a_current_mtp_layer_and_output_stays_plain(mtp_model, helpers):
    (p,) = helpers.prompts(1, 5, 9, seed=22)
    max_tokens = 8 + RETRY_AFTER + 12
    eng = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=2,
                                                   spec_min_acceptance=1.0, spec_batch_rule="size"))
    # random MTP weights: drafts fail ("size": the cost rule would stop speculating before the switch-off)
    tracker = eng.runner.tracker
    seq = eng.make_sequence(p, greedy(max_tokens))
    eng.add_sequence(seq)
    while tracker.retries == 0:
        eng.step()
    assert tracker.switched_off == 1 and tracker.verifications == WINDOW
    picked: list[torch.Tensor] = []
    pick = eng.runner.drafter._pick
    eng.runner.drafter._pick = lambda logits, seqs: picked.append(logits[0].clone()) or pick(logits, seqs)
    eng.step()  # drafts again: the MTP layer over the positions decoded plainly since the switch-off
    eng.runner.drafter._pick = pick
    torch.testing.assert_close(picked[0], mtp_logits(mtp_model, seq.token_ids), atol=1e-6, rtol=0)
    while eng.has_unfinished():
        eng.step()
    assert tracker.verifications > WINDOW
    assert seq.output_ids == helpers.reference_greedy(mtp_model, p, max_tokens)
    assert eng.stats().extra["spec_decode_requests_retried"] == 1.0
