"""Speculative decoding in the engine: greedy output equals plain decoding token for token (alone,
batched, with prefix hits and preemption), with the real MTP drafter and with an oracle drafter
that proposes the right tokens with planted mistakes, so that every accepted length 0..K and its
KDA rollback occur."""

from __future__ import annotations

import random

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.serve.api.metrics import ServerMetrics
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.mtp_drafter import MTPDrafter

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mtp_model(helpers):
    return build_model(helpers.k31_tiny(num_nextn_predict_layers=1), seed=3).eval()


class OracleDrafter(MTPDrafter):
    """The MTP drafter's work, then its draft tokens replaced by the reference continuation, wrong
    at a fixed pseudo-random 30 % of positions: accepted lengths vary over 0..K."""

    def __init__(self, model, cache, k: int, references: dict[tuple[int, ...], list[int]], compiled=None):
        super().__init__(model, cache, k, compiled)
        self.references = references

    def run(self, rows):
        drafts = super().run(rows)
        for row, d in zip(rows, drafts):
            if d is None:
                continue
            seq = row.seq
            ref = self.references[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            for j in range(len(d.tokens)):
                i = d.position + 1 + j - seq.num_prompt_tokens
                right = ref[i] if i < len(ref) else 0
                d.tokens[j] = (right + 1) % 256 if random.Random(d.position + 1 + j).random() < 0.3 else right
        return drafts


def engine(model, k: int, oracle: dict | None = None, **overrides) -> LLMEngine:
    # spec_max_batch=0: every batch speculates (the batch-size rule has tests of its own, test_batch_rule.py)
    config = dict(cache_memory="8MiB", speculative="mtp", num_draft_tokens=k, spec_min_acceptance=0.0, spec_max_batch=0)
    config.update(overrides)
    eng = LLMEngine(model, config=EngineConfig(**config))
    if oracle is not None:
        eng.runner.drafter = OracleDrafter(model, eng.cache, k, oracle, eng.runner.drafter.compiled)
    return eng


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def batch(mtp_model, helpers):
    ps = helpers.prompts(5, 3, 40, seed=11)
    return ps, {tuple(p): helpers.reference_greedy(mtp_model, p, MAX_TOKENS) for p in ps}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batched_greedy_equals_plain_with_every_accepted_length(mtp_model, batch, k):
    ps, refs = batch
    eng = engine(mtp_model, k, oracle=refs)
    out = eng.generate(ps, greedy(), progress=False)
    assert [c.token_ids for c in out] == [refs[tuple(p)] for p in ps]
    tracker = eng.runner.tracker
    assert tracker.verifications > 0
    rates = tracker.acceptance_rates()
    assert all(0 < r < 1 for r in rates) and rates == sorted(rates, reverse=True)  # some kept everywhere, never all


def test_blocks_past_the_kept_tokens_go_back(mtp_model, batch):
    ps, refs = batch
    k = 3
    eng = engine(mtp_model, k, oracle=refs, block_size=2)
    seqs = [eng.make_sequence(p, greedy()) for p in ps[:3]]
    for seq in seqs:
        eng.add_sequence(seq)
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:  # the tokens, and the provisional positions of drafts 2..K
            assert len(seq.block_table) <= -(-(len(seq.token_ids) + k - 2) // 2)
    assert [s.output_ids for s in seqs] == [refs[tuple(p)] for p in ps[:3]]
    assert eng.cache.blocks.num_free == eng.cache.blocks.num_blocks


def test_real_mtp_drafter_alone_and_stats(mtp_model, batch):
    ps, refs = batch
    eng = engine(mtp_model, 2)
    for p in ps[:2]:
        assert eng.generate([p], greedy(), progress=False)[0].token_ids == refs[tuple(p)]
    extra = eng.stats().extra
    assert extra["spec_decode_verifications"] > 0
    assert set(extra) >= {"spec_decode_acceptance_rate_position_1", "spec_decode_acceptance_rate_position_2"}
    text = ServerMetrics(eng.stats).render().decode()
    assert f"deltamoe_engine_spec_decode_verifications_total {extra['spec_decode_verifications']}" in text
    assert "deltamoe_engine_spec_decode_acceptance_rate_position_2 " in text
    assert "# TYPE deltamoe_engine_spec_decode_accepted_tokens_total counter" in text  # totals: rate() works
    assert "# TYPE deltamoe_engine_spec_decode_acceptance_rate_position_2 gauge" in text


def test_prefix_hits_and_preemption(mtp_model, helpers):
    shared = list(range(60, 60 + 40))
    ps = [shared + [i, i + 1] for i in range(1, 5)]
    refs = {tuple(p): helpers.reference_greedy(mtp_model, p, MAX_TOKENS) for p in ps}
    # A follow-up turn: hits blocks and KDA snapshots taken at boundaries inside verified runs.
    follow = ps[0] + refs[tuple(ps[0])][:16]
    refs[tuple(follow)] = helpers.reference_greedy(mtp_model, follow, MAX_TOKENS)
    # A cache that holds about two sequences: four running together preempt each other.
    eng = engine(mtp_model, 2, oracle=refs, cache_memory=40_000, block_size=4, snapshot_interval_blocks=1)
    assert eng.generate(ps[:1], greedy(), progress=False)[0].token_ids == refs[tuple(ps[0])]
    assert eng.generate([follow], greedy(), progress=False)[0].token_ids == refs[tuple(follow)]
    assert eng.stats().prefix_hit_tokens > len(ps[0])
    rest = eng.generate(ps[1:], greedy(), progress=False)
    assert [c.token_ids for c in rest] == [refs[tuple(p)] for p in ps[1:]]
    assert eng.scheduler.num_preemptions > 0


def test_stop_token_inside_drafts_and_logprobs(mtp_model, batch):
    ps, refs = batch
    p = ps[0]
    stop = refs[tuple(p)][7]
    plain = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB"))
    params = greedy(stop_token_ids=[stop], logprobs=2)
    want = plain.generate([p], params, progress=False)[0]
    got = engine(mtp_model, 3, oracle=refs).generate([p], params, progress=False)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_speculation_switches_off_below_threshold(mtp_model, batch, helpers):
    ps, refs = batch
    eng = engine(mtp_model, 2, spec_min_acceptance=1.0)  # random MTP weights: drafts rarely land
    out = eng.generate(ps[:2], greedy(max_tokens=30), progress=False)
    assert [c.token_ids for c in out] == [helpers.reference_greedy(mtp_model, p, 30) for p in ps[:2]]
    assert eng.runner.tracker.switched_off == 2
    assert eng.runner.tracker.verifications == 2 * 8  # the judging window, then plain decoding


def test_sampling_runs_and_is_reproducible(mtp_model, batch):
    ps, refs = batch
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    a = engine(mtp_model, 2, oracle=refs).generate(ps[:2], params, progress=False)
    b = engine(mtp_model, 2, oracle=refs).generate(ps[:2], params, progress=False)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert all(len(c.token_ids) == MAX_TOKENS for c in a)


def test_config_errors(mtp_model, helpers):
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative="mtp", num_draft_tokens=4)
    assert e.value.field == "num_draft_tokens"
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative="eagle")
    assert e.value.field == "speculative"
    no_mtp = build_model(helpers.k31_tiny(), seed=3).eval()
    with pytest.raises(ConfigError) as e:
        LLMEngine(no_mtp, config=EngineConfig(cache_memory="8MiB", speculative="mtp"))
    assert e.value.field == "speculative"


@pytest.mark.slow
def test_compiled_decode_for_switched_off_rows(mtp_model, batch, helpers):
    """With --compile, rows that stop speculating run the compiled graph; output stays the same."""
    from deltamoe.serve.engine.compiled_decode import compiler_available

    if not compiler_available():
        pytest.skip("no C++ compiler for torch.compile's CPU kernels")
    ps, _ = batch
    eng = engine(mtp_model, 2, spec_min_acceptance=1.0, compile_decode=True)
    out = eng.generate(ps[:3], greedy(max_tokens=30), progress=False)
    assert [c.token_ids for c in out] == [helpers.reference_greedy(mtp_model, p, 30) for p in ps[:3]]
    assert eng.runner.tracker.switched_off == 3


@pytest.mark.slow
def test_compiled_verification_equals_plain(mtp_model, batch, monkeypatch):
    """With --compile, verifications run through their compiled regions (T = K + 1): greedy output
    equals plain decoding alone and in a batch, with every accepted length and its rollback; the MTP
    layer's compiled calls draft what its eager calls draft."""
    from deltamoe.serve.engine.compiled_decode import compiler_available
    from deltamoe.serve.spec_decode.compiled_draft import CompiledDraft
    from deltamoe.serve.spec_decode.compiled_verify import CompiledVerify

    if not compiler_available():
        pytest.skip("no C++ compiler for torch.compile's CPU kernels")
    ps, refs = batch
    calls: list[tuple[int, ...]] = []
    original = CompiledVerify.__call__
    monkeypatch.setattr(CompiledVerify, "__call__",
                        lambda self, ids, view: calls.append(tuple(ids.shape)) or original(self, ids, view))
    eng = engine(mtp_model, 2, oracle=refs, compile_decode=True)
    alone = eng.generate(ps[:1], greedy(), progress=False)
    together = eng.generate(ps[1:4], greedy(), progress=False)
    assert [c.token_ids for c in alone + together] == [refs[tuple(p)] for p in ps[:4]]
    assert {shape[0] for shape in calls} >= {1, 3} and {shape[1] for shape in calls} == {3}
    rates = eng.runner.tracker.acceptance_rates()
    assert all(0 < r < 1 for r in rates)

    # The MTP layer's own drafts through its compiled region: the same acceptance, step by step.
    compiled_calls: list[bool] = []
    runs = CompiledDraft.runs
    monkeypatch.setattr(CompiledDraft, "runs", staticmethod(
        lambda starts, counts: compiled_calls.append(runs(starts, counts)) or compiled_calls[-1]))
    compiled, eager = engine(mtp_model, 2, compile_decode=True), engine(mtp_model, 2)
    for eng in (compiled, eager):
        assert [c.token_ids for c in eng.generate(ps[:3], greedy(), progress=False)] == [refs[tuple(p)] for p in ps[:3]]
    assert True in compiled_calls and False in compiled_calls  # prompt catch-ups stay eager
    assert compiled.runner.tracker.accepted_at == eager.runner.tracker.accepted_at
    assert compiled.runner.tracker.verifications == eager.runner.tracker.verifications > 0


@pytest.mark.slow
def test_warm_up_reaches_compiled_verification_and_leaves_no_stats(mtp_model, batch, monkeypatch):
    """A server's warm-up verifies at batch 1 and 2 (compiling those graphs before traffic) and puts
    the acceptance statistics back."""
    from deltamoe.serve.engine.compiled_decode import compiler_available
    from deltamoe.serve.spec_decode.compiled_verify import CompiledVerify

    if not compiler_available():
        pytest.skip("no C++ compiler for torch.compile's CPU kernels")
    batches: list[int] = []
    original = CompiledVerify.__call__
    monkeypatch.setattr(CompiledVerify, "__call__",
                        lambda self, ids, view: batches.append(ids.shape[0]) or original(self, ids, view))
    ps, refs = batch
    eng = engine(mtp_model, 2, compile_decode=True, max_model_len=64)
    eng.warm_up()
    assert {1, 2} <= set(batches)
    assert eng.runner.tracker.verifications == 0 and eng.runner.tracker.accepted_at == [0, 0]
    assert eng.stats().generation_tokens_total == 0
    out = eng.generate(ps[:2], greedy(), progress=False)
    assert [c.token_ids for c in out] == [refs[tuple(p)] for p in ps[:2]]


@torch.inference_mode()
def test_drafts_are_the_trained_mtp_predictions(mtp_model, batch):
    """Draft 1 is the argmax of the MTP head as training computes it over the whole sequence (h_i
    and token i+1 -> token i+2); draft 2 reuses the head on its own output and draft 1."""
    ps, refs = batch
    p = ps[1]
    eng = engine(mtp_model, 2)
    seq = eng.make_sequence(p, greedy())
    eng.add_sequence(seq)
    while not seq.output_ids:  # prefill: samples x_m, the MTP layer catches up over the prompt and drafts
        eng.step()
    drafts = eng.runner.tracker.state(seq).drafts
    ids = torch.tensor([p + [refs[tuple(p)][0]]])
    inner, mtp = mtp_model.model, mtp_model.model.mtp_layers[0]
    h = inner(ids)
    out = mtp(h[:, :-1], inner.embed_tokens(ids[:, 1:]))
    assert drafts.position == len(p)
    assert drafts.tokens[0] == int(mtp.logits(out[0, -1]).argmax())
    again = mtp(torch.cat([h[:, :-1], out[:, -1:]], 1), inner.embed_tokens(torch.cat(
        [ids[:, 1:], torch.tensor([[drafts.tokens[0]]])], 1)))
    assert drafts.tokens[1] == int(mtp.logits(again[0, -1]).argmax())


def test_grammar_and_logit_bias_requests_decode_plainly_with_the_plain_output(mtp_model, helpers):
    """Verification does not apply a grammar's mask or a logit_bias to its targets: such requests run
    without drafts, beside speculating ones, and answer exactly as a plain engine does."""
    from deltamoe.serve.structured.constraint import regex_constraint

    prompts = helpers.prompts(3, 5, 20, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={50: -100.0, 51: 5.0}),
              SamplingParams(max_tokens=12, temperature=0.0, structured=regex_constraint("[a-c]{3}[0-9]{2}", "r")),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    plain = LLMEngine(mtp_model, config=EngineConfig(cache_memory="8MiB")).generate(prompts, params, progress=False)
    spec = engine(mtp_model, 2)
    got = spec.generate(prompts, params, progress=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert spec.runner.tracker.verifications > 0  # the third request did speculate


def test_prompt_logprobs_equal_plain_decoding(mtp_model):
    """A speculating engine's prefill projects the chunk's hidden states for a request that asks for
    prompt logprobs, as the plain runner does (it refused them; before that it dropped them): over
    several chunks, beside a request that asks for none, equal to plain decoding."""
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9]]
    config = dict(cache_memory="8MiB", max_num_batched_tokens=16)
    plain = LLMEngine(mtp_model, config=EngineConfig(**config)).generate(prompts, params, progress=False)
    spec = LLMEngine(mtp_model, config=EngineConfig(**config, speculative="mtp", num_draft_tokens=2,
                                                    spec_min_acceptance=0.0))
    got = spec.generate(prompts, params, progress=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert got[1].prompt_logprobs is None
    a, b = got[0].prompt_logprobs, plain[0].prompt_logprobs
    assert len(a) == len(b) == len(prompts[0]) - 1
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-5)
    assert [[i for i, _ in t.top] for t in a] == [[i for i, _ in t.top] for t in b]
    assert spec.runner.tracker.verifications > 0
