"""n > 1 and best_of through the official `openai` SDK: choice i is the request with seed + i,
streamed chunks carry their choice's index, best_of keeps the likeliest, limits are 400s."""

from __future__ import annotations

import openai
import pytest

from deltamoe.serve.engine.config import EngineConfig

M = "tiny"
PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def client(tmp_path_factory, helpers):
    config = EngineConfig(cache_memory="1MiB", max_model_len=512)
    with helpers.openai_server(tmp_path_factory.mktemp("ckpt"), config) as client:
        yield client


def one(client, seed, **kw):
    return client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, **kw).choices[0]


def test_n_choices_are_the_seeded_requests(client):
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [one(client, 5 + i).text for i in range(3)]
    assert r.usage.prompt_tokens == len(PROMPT.encode()) and r.usage.completion_tokens == 3 * 8
    stream = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True,
                                       stream_options={"include_usage": True})
    texts, usage = ["", "", ""], None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in r.choices] and usage.completion_tokens == 24
    chat = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=1.0, seed=9, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_best_of_keeps_the_likeliest(client):
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, best_of=3)
    candidates = [one(client, 7 + i, logprobs=0) for i in range(3)]
    best = max(candidates, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(r.choices) == 1 and r.choices[0].text == best.text and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 3 * 8


@pytest.mark.parametrize("kw, param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 3, "extra_body": {"best_of": 2}}, "best_of"),
    ({"n": 1, "stream": True, "extra_body": {"best_of": 2}}, "best_of"),
    ({"n": 16, "max_tokens": 400}, "n"),  # 16 x 400 tokens > the cache's 4,800
    ({"n": 2, "max_tokens": 400, "extra_body": {"best_of": 16}}, "best_of"),  # best_of asked for the 16
])
def test_limits(client, kw, param):
    kw = {"max_tokens": 8, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=M, prompt=PROMPT, **kw)
    assert e.value.param == param


def test_seeds_past_the_largest_wrap_instead_of_failing(client):
    """Choice i's seed is seed + i: past 2**64 - 1 it wraps to 0, 1, ... (was a 500, an overflow)."""
    top = 2**64 - 1
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=top, n=3)
    assert [c.text for c in r.choices] == [one(client, s).text for s in (top, 0, 1)]
    chat = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=1.0, seed=top, n=2)
    assert len(chat.choices) == 2


def test_continuous_usage_counts_every_choice_so_far(client):
    stream = client.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2,
                                       stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True})
    usages = [chunk.usage.completion_tokens for chunk in stream if chunk.choices]
    assert usages and all(u is not None for u in usages)
    assert usages == sorted(usages) and usages[-1] == 12  # grows with each chunk, to both choices' tokens


def test_a_list_of_prompts_answers_each_as_its_own_request(client):
    """OpenAI's batch (lm-eval sends one with batch_size > 1): prompt b's choices are b*n .. b*n+n-1,
    each equal to the request for that prompt alone; usage adds up the prompts."""
    prompts = [PROMPT, "Tell me", "A"]
    r = client.completions.create(model=M, prompt=prompts, max_tokens=6, temperature=1.0, seed=4, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [client.completions.create(model=M, prompt=p, max_tokens=6, temperature=1.0, seed=4, n=2) for p in prompts]
    assert [c.text for c in r.choices] == [c.text for a in alone for c in a.choices]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 6 * 6
    stream = client.completions.create(model=M, prompt=prompts, max_tokens=6, temperature=1.0, seed=4, n=2,
                                       stream=True)
    texts = [""] * 6
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    # Token-id prompts, echo with logprobs (lm-eval's loglikelihood batch), best_of kept per prompt.
    ids = [[256, 72, 105], [256, 65]]
    echoed = client.completions.create(model=M, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=0)
    for c, p in zip(echoed.choices, ids):
        one_ = client.completions.create(model=M, prompt=p, max_tokens=1, temperature=0, echo=True, logprobs=0).choices[0]
        assert c.text == one_.text and c.logprobs.tokens == one_.logprobs.tokens
        # Prefilled beside the other prompt: the same sums, in another order (fp32 rounding).
        assert c.logprobs.token_logprobs[1:] == pytest.approx(one_.logprobs.token_logprobs[1:], abs=1e-5)
    best = client.completions.create(model=M, prompt=prompts[:2], max_tokens=6, temperature=1.0, seed=7, best_of=3)
    assert [c.text for c in best.choices] == [client.completions.create(
        model=M, prompt=p, max_tokens=6, temperature=1.0, seed=7, best_of=3).choices[0].text for p in prompts[:2]]


def test_too_many_prompts_is_a_400_naming_prompt(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=M, prompt=["a"] * 20, max_tokens=2, n=16)
    assert e.value.param == "prompt"
