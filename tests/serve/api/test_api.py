"""The OpenAI-compatible server, end to end: the official `openai` client against a real uvicorn.

The server's answers are held to the offline engine on the same checkpoint: each request has
its own seeded generator, so what a request gets does not depend on the server or the batch.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

API_KEY = "sk-test"
MODEL = "tiny-k31"
# A checkpoint template distinct from the default one, to show the server uses the checkpoint's.
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|end|>{% endfor %}" \
           "{% if add_generation_prompt %}[assistant]{% endif %}"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory, helpers):
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(build_model(helpers.k31_tiny(), seed=11), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    config = EngineConfig(cache_memory="32MiB", max_model_len=MAX_MODEL_LEN)
    engine = AsyncLLMEngine.from_pretrained(folder, config)
    template = ChatTemplate.for_model(engine.tokenizer, folder)
    app = build_app(engine, MODEL, api_key=API_KEY, chat_template=template, max_body_bytes=2**20)
    offline = LLMEngine.from_pretrained(folder, EngineConfig(cache_memory="32MiB", max_model_len=MAX_MODEL_LEN))
    with ServerThread(app) as thread:
        yield SimpleNamespace(url=thread.url, engine=engine, template=template, offline=offline, app=app)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def offline(server, prompt, **params):
    return server.offline.generate([prompt], SamplingParams(**params), progress=False)[0]


def test_health_models_and_api_key(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # no key needed outside /v1
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "sk-test"}, {"Authorization": "Basic sk-test"}):
        r = httpx.post(f"{server.url}/v1/completions", headers=headers, json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_completion_matches_the_offline_engine(server, client):
    prompt = "The quick brown fox"
    ref = offline(server, prompt, max_tokens=12, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=list(prompt.encode()), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == ref.text


@pytest.mark.parametrize("route, body", [("completions", {"prompt": "The quick brown fox"}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_an_omitted_model_is_the_served_one(server, route, body):
    """As vLLM: a request without `model` goes to the one model served (OpenAI requires the field)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    without = httpx.post(f"{server.url}/v1/{route}", headers=auth, json={**body, "max_tokens": 4, "temperature": 0})
    named = httpx.post(f"{server.url}/v1/{route}", headers=auth,
                       json={**body, "model": MODEL, "max_tokens": 4, "temperature": 0})
    assert without.status_code == 200 and without.json()["model"] == MODEL
    assert without.json()["choices"] == named.json()["choices"]


def test_sampling_fields_reach_the_engine(server, client):
    fields = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=1.5)
    extra = dict(top_k=40, min_p=0.02, ignore_eos=True)
    ref = offline(server, "abc", max_tokens=20, **fields, **extra)
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, extra_body=extra, **fields)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, extra_body=extra, **fields)
    other = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, extra_body=extra,
                                      **{**fields, "seed": 99})
    assert again.choices[0].text == r.choices[0].text and other.choices[0].text != r.choices[0].text


def test_streaming_completion_with_usage(server, client):
    kw = dict(model=MODEL, prompt="hello there", max_tokens=16, temperature=0.7, seed=5, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens == len(b"hello there")
    assert len({c.id for c in chunks}) == 1


def test_sse_framing(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert sum(json.loads(e[6:])["choices"][0]["finish_reason"] == "length" for e in events[:-2]) == 1


def test_chat_uses_the_checkpoint_template(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = server.template.encode(messages)
    assert ids[:6] == list(b"[syste")  # the checkpoint's template, not the default specials
    ref = offline(server, ids, max_tokens=10, temperature=0, stop_token_ids=server.template.stop_token_ids)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and chunks[-1].choices == []


def test_stop_strings_cut_the_text(server, client):
    kw = dict(model=MODEL, prompt="stop here", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # The first character (past the start) that is a whole character and occurs there first.
    k = next(i for i in range(1, len(full)) if full[i] != "\ufffd" and full.index(full[i]) == i)
    r = client.completions.create(stop=[full[k], "never-there"], **kw)
    assert r.choices[0].text == full[:k]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == full[k]


def test_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert tok.logprob == pytest.approx(tops[0])  # greedy takes the most likely token
        assert tok.bytes == list(tok.token.encode()) or "\ufffd" in tok.token

    c = client.completions.create(model=MODEL, prompt="y", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # Where each token starts in the returned text: a token alone in its output starts where the text
    # before it ends (tokens' own texts overcounted skipped specials and half characters).
    text, starts = c.choices[0].text, lp.text_offset
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] <= len(text)
    assert text == "".join(text[a:b] for a, b in zip(starts, [*starts[1:], len(text)]))
    for a, b, token in zip(starts, [*starts[1:], len(text)], lp.tokens):
        assert text[a:b] in (token, "") or "\ufffd" in token
    # A special token (skipped from the text) takes no room: offsets stay inside the text.
    c = client.completions.create(model=MODEL, prompt="y", max_tokens=3, temperature=0, logprobs=0,
                                  logit_bias={"261": 100}, extra_body={"ignore_eos": True})
    assert c.choices[0].logprobs.tokens == ["<|assistant|>"] * 3 and c.choices[0].text == ""
    assert c.choices[0].logprobs.text_offset == [0, 0, 0]  # was [0, 13, 26]
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_metrics_count_requests_and_latencies(server, client):
    shared = "a prompt long enough to fill a few cache blocks, sent twice"
    for _ in range(2):  # the second one is served from the prefix cache
        client.completions.create(model=MODEL, prompt=shared, max_tokens=3, extra_body={"ignore_eos": True})
    httpx.post(f"{server.url}/v1/completions", content=b"{", headers={"Authorization": f"Bearer {API_KEY}"})
    text = httpx.get(f"{server.url}/metrics").text

    def value(pattern: str) -> float:
        m = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
        assert m, pattern
        return float(m.group(1))

    assert value(r'deltamoe_http_requests_total\{endpoint="/v1/completions",status="200"\}') >= 1
    assert value(r'deltamoe_http_requests_total\{endpoint="/v1/completions",status="400"\}') >= 1
    assert value("deltamoe_time_to_first_token_seconds_count") >= 1
    assert value("deltamoe_time_per_output_token_seconds_count") >= 1
    assert value("deltamoe_e2e_request_latency_seconds_count") >= 1
    assert value(r'deltamoe_request_finished_total\{finish_reason="length"\}') >= 1
    assert value("deltamoe_generation_tokens_total") >= 3
    assert value("deltamoe_num_requests_running") == 0
    assert value("deltamoe_kv_cache_usage_ratio") == value("deltamoe_state_slot_usage_ratio") == 0
    assert value("deltamoe_num_preemptions_total") == 0  # the cache is far larger than these requests need
    hits, queries = value("deltamoe_prefix_cache_hit_tokens_total"), value("deltamoe_prefix_cache_query_tokens_total")
    assert hits >= 32 and value("deltamoe_prefix_cache_hit_rate") == pytest.approx(hits / queries)


def test_tokenize_and_detokenize(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.url}/tokenize", headers=headers,
                   json={"model": MODEL, "prompt": "héllo", "return_token_strs": True}).json()
    assert r["tokens"] == list("héllo".encode()) and r["count"] == 6 and r["max_model_len"] == MAX_MODEL_LEN
    assert len(r["token_strs"]) == 6
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", headers=headers, json={"messages": messages}).json()
    assert chat["tokens"] == server.template.encode(messages)  # what /v1/chat/completions feeds the model
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert used == chat["count"]
    back = httpx.post(f"{server.url}/detokenize", headers=headers, json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": "[user]hi<|end|>[assistant]"}  # specials by name


def test_logit_bias_forces_and_bans_tokens(server, client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    forced = client.completions.create(logit_bias={str(ord("Q")): 100}, **kw).choices[0].text
    assert forced == "Q" * 6 != plain
    first = plain.encode()[0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].text
    assert banned.encode()[0] != first
    # Sampled too, not only greedy: the bias is applied before temperature.
    hot = client.completions.create(logit_bias={str(ord("Q")): 100}, **{**kw, "temperature": 1.5, "seed": 3})
    assert hot.choices[0].text == "Q" * 6


def test_continuous_usage_stats_and_accepted_extras(server, client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="hey", max_tokens=5, stream=True, user="u-1",
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "metadata": {"team": "a"}}))
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == 3 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
