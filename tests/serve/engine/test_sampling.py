"""Sampling: masks on hand-made logits, penalties, logprobs, seeds; stop strings and UTF-8 in the detokenizer."""

from __future__ import annotations

import math

import pytest
import torch

from deltamoe.errors import RequestError
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.detokenizer import IncrementalDetokenizer
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import (SamplingParams, apply_logit_bias, apply_penalties, filter_logits, sample_row,
                                            token_logprobs)
from deltamoe.tokenizers.byte import ByteTokenizer

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logits)).flatten().tolist()


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert kept(filter_logits(logits, top_p=0.5)) == [0]  # 0.5 alone reaches 0.5
    assert kept(filter_logits(logits, top_p=0.6)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.9)) == [0, 1, 2]
    assert kept(filter_logits(logits, top_p=0.01)) == [0]  # never empty


def test_min_p_is_relative_to_the_top_token():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(filter_logits(logits, min_p=0.5)) == [0, 1]  # 0.3 >= 0.25, 0.15 < 0.25
    assert kept(filter_logits(logits, min_p=0.2)) == [0, 1, 2]


def test_penalties_follow_openai_formula():
    logits = torch.zeros(5)
    out = apply_penalties(logits, [1, 1, 3], presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, -(2 * 0.25 + 0.5), 0.0, -(0.25 + 0.5), 0.0]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    lp = token_logprobs(logits, 1, top_n=2)
    ref = torch.log_softmax(logits, -1)
    assert lp.token_id == 1 and math.isclose(lp.logprob, float(ref[1]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1] and math.isclose(lp.top[0][1], float(ref[0]), rel_tol=1e-6)


def test_greedy_and_seeded_draws():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_row(logits, SamplingParams(temperature=0), [], torch.Generator())[0] == 1
    params = SamplingParams(temperature=1.0, seed=7)
    draws = lambda: [sample_row(logits, params, [], g)[0] for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    assert draws() == draws()
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert {sample_row(logits, top1, [], torch.Generator().manual_seed(s))[0] for s in range(10)} == {1}


def test_a_vanishing_temperature_is_greedy(k31_model):
    # 1e-300 would overflow logits / T to inf and the probabilities to NaN: the limit T -> 0 is argmax
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                             progress=False)[0].token_ids
    for t in (1e-300, 1e-6):
        tiny = SamplingParams(max_tokens=6, temperature=t, ignore_eos=True, seed=3)
        assert tiny.greedy and engine.generate([[5, 6, 7]], tiny, progress=False)[0].token_ids == greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_same_seed_same_output_in_any_batch(k31_model, helpers):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    p = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([p], params, progress=False)[0].token_ids
    others = helpers.prompts(7, 3, 20, seed=4)
    mixed = engine.generate(others + [p], [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)] * 7 + [params],
                            progress=False)
    assert mixed[-1].token_ids == alone
    other_seed = engine.generate([p], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=99,
                                                     ignore_eos=True), progress=False)[0].token_ids
    assert other_seed != alone


def test_engine_logprobs_match_the_model(k31_model):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    prompt = [10, 20, 30]
    out = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, logprobs=3, ignore_eos=True),
                          progress=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(k31_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(ref.argmax())
    assert math.isclose(first.logprob, float(ref.max()), rel_tol=1e-4, abs_tol=1e-5)
    assert [t for t, _ in first.top] == torch.topk(ref, 3).indices.tolist() and len(out.logprobs) == 2


# ------------------------------------------------------------------ detokenizer
def feed(detok: IncrementalDetokenizer, data: bytes) -> list[str]:
    return [detok.push(b) for b in data]


def test_utf8_is_held_back_until_complete():
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = feed(detok, "a€😀".encode())  # 1 + 3 + 4 bytes
    assert pieces == ["a", "", "", "€", "", "", "", "😀"]
    assert detok.flush() == "" and detok.text == "a€😀"


def test_cut_character_at_the_end_becomes_replacement():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert feed(detok, "é".encode()[:1]) == [""]
    assert detok.flush() == "\ufffd"



@pytest.mark.parametrize("data", ["a€😀 plain".encode(), "é".encode()[:1], "x".encode() + bytes([0xFF]) + "ü".encode()])
def test_deferred_text_equals_the_streamed_text(data: bytes) -> None:
    """Offline generation decodes once at the end (`stream=False`): same final text, cut characters
    and invalid bytes included; with stop strings it stays incremental (they need checking per token)."""
    tok = ByteTokenizer()
    streamed, deferred = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, stream=False)
    pieces = "".join(feed(streamed, data)) + streamed.flush()
    assert feed(deferred, data) == [""] * len(data)
    assert deferred.flush() == pieces and deferred.text == streamed.text == pieces
    with_stop = IncrementalDetokenizer(tok, stop=["lain"], stream=False)
    feed(with_stop, data)
    assert with_stop.stopped_by == ("lain" if b"plain" in data else None)

def test_stop_string_across_tokens_is_never_emitted():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["END"])
    pieces = feed(detok, b"abcENxEND tail")
    assert "".join(pieces) == "abcENx"
    assert detok.stopped_by == "END" and detok.text == "abcENx"
    assert pieces[3:5] == ["", ""]  # 'E', 'N' held: they could start 'END'
    assert feed(detok, b"more") == ["", "", "", ""]


def test_include_stop_string_and_skip_specials():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["lo"], include_stop_str_in_output=True)
    assert "".join(feed(detok, b"hello")) == "hello"[:5] and detok.text == "hello"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert detok.push(tok.special_tokens["<|end|>"]) == "<|end|>"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.special_tokens["<|end|>"]) == "" and detok.push(9999) == ""


def test_engine_stop_string_output(k31_model, helpers):
    """Whatever the model says, the text ends right before the first occurrence of a stop string."""
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    prompt = helpers.prompts(1, 6, 6, seed=2)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), progress=False)[0]
    raw = ByteTokenizer().decode(full.token_ids)
    stop = raw[3:5] if len(raw) >= 5 else None
    if stop is None or not stop.strip("\ufffd"):
        pytest.skip("model output too short for a stop string")
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True),
                          progress=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == raw[: raw.index(stop)]


def test_logit_bias_is_validated_and_shifts_the_logits():
    for bad in ({10: 1.0}, {-1: 1.0}, {1: 101.0}, {1: float("nan")}, {True: 1.0}):
        with pytest.raises(RequestError) as e:
            SamplingParams(logit_bias=bad).validate(vocab_size=10)
        assert e.value.field == "logit_bias"
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert apply_logit_bias(logits, {0: 10.0, 2: -1.0}).tolist() == [10.0, 5.0, 0.0, 2.0]
    gen = torch.Generator().manual_seed(0)
    assert sample_row(logits, SamplingParams(temperature=0, logit_bias={3: 100}), [], gen)[0] == 3
    assert sample_row(logits, SamplingParams(temperature=1.0, logit_bias={1: -100, 3: 100}), [], gen)[0] == 3


def test_engine_penalties_read_the_outputs_so_far(k31_model, helpers):
    """The runner hands sampling a row's output ids only where penalties read them
    (`runner.penalised_outputs`); a penalised row must still see every token it produced: greedy with the
    largest penalties never repeats a token (the tiny model's logits differ by far less than 4), where
    the same prompt unpenalised does."""
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    prompt = helpers.prompts(1, 4, 4, seed=7)[0]
    plain, penalised = (engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                                 frequency_penalty=f, presence_penalty=f),
                                                  progress=False)[0].token_ids
                        for f in (0.0, 2.0))
    assert len(set(plain)) < len(plain)  # the unpenalised greedy run repeats itself
    assert len(set(penalised)) == len(penalised) == 24
