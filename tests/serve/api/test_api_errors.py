"""Bad input never crashes the server: each case is a 4xx with an OpenAI error body naming the field.

The cases run one after another on one server (and one keep-alive connection), then a good
request must still succeed: nothing may have broken the engine, the app or the connection.
"""

from __future__ import annotations

import json

import httpx
import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig

KEY = "sk-errors"
M = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, helpers):
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(build_model(helpers.k31_tiny(), seed=2), folder)
    engine = AsyncLLMEngine.from_pretrained(folder, EngineConfig(cache_memory="16MiB", max_model_len=128))
    with ServerThread(build_app(engine, M, api_key=KEY, max_body_bytes=2**20)) as thread:
        yield thread.url, engine


def raw(body: dict) -> bytes:
    return json.dumps(body).encode()


# (path, body bytes, headers, status, param, code)
CASES = [
    (CMPL, b'{"model": ', AUTH, 400, None, "invalid_json"),
    (CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}', AUTH, 400, None, "invalid_json"),  # not UTF-8
    (CMPL, b"", AUTH, 400, None, "invalid_json"),
    (CMPL, b"[1, 2]", AUTH, 400, None, "invalid_type"),
    (CMPL, raw({"model": "gpt-4", "prompt": "a"}), AUTH, 404, "model", "model_not_found"),
    (CMPL, raw({"model": M, "prompt": "a", "temperature": "hot"}), AUTH, 400, "temperature", "float_type"),
    (CMPL, raw({"model": M, "prompt": "a", "max_tokens": 1.5}), AUTH, 400, "max_tokens", "int_type"),
    (CMPL, raw({"model": M, "prompt": {"text": "a"}}), AUTH, 400, "prompt", "value_error"),
    (CMPL, raw({"model": M, "prompt": ["a", [1, 2]]}), AUTH, 400, "prompt", "value_error"),  # strings and ids mixed
    (CMPL, raw({"model": M, "prompt": ["a", ""]}), AUTH, 400, "prompt", "invalid_value"),  # one empty prompt of a batch
    (CMPL, raw({"model": M, "prompt": [10**9]}), AUTH, 400, "prompt", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": ""}), AUTH, 400, "prompt", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "max_tokens": -5}), AUTH, 400, "max_tokens", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "max_tokens": 10**12}), AUTH, 400, "max_tokens", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a" * 200}), AUTH, 400, "prompt", "invalid_value"),  # > max_model_len
    (CMPL, raw({"model": M, "prompt": "a", "temperature": -1}), AUTH, 400, "temperature", "invalid_value"),
    (CMPL, b'{"model": "tiny", "prompt": "a", "temperature": NaN}', AUTH, 400, "temperature", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "top_p": 0}), AUTH, 400, "top_p", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "stop": [""]}), AUTH, 400, "stop", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "stop": 5}), AUTH, 400, "stop", "value_error"),
    (CMPL, raw({"model": M, "prompt": "a", "seed": 2**70}), AUTH, 400, "seed", "less_than_equal"),
    (CMPL, raw({"model": M, "prompt": "a", "logprobs": 99}), AUTH, 400, "logprobs", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "n": 17}), AUTH, 400, "n", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "prompt_logprobs": 99}), AUTH, 400, "prompt_logprobs", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "prompt_logprobs": 99}), AUTH, 400, "prompt_logprobs", "invalid_value"),
    # vLLM's sampling extensions that are not implemented are refused, never dropped
    (CMPL, raw({"model": M, "prompt": "a", "min_tokens": 5}), AUTH, 400, "min_tokens", "unsupported_value"),
    (CHAT, raw({"model": M, "messages": USER, "repetition_penalty": 1.2}), AUTH, 400, "repetition_penalty",
     "unsupported_value"),
    (CMPL, raw({"model": M, "prompt": "a", "use_beam_search": True}), AUTH, 400, "use_beam_search", "unsupported_value"),
    (CMPL, raw({"model": M, "prompt": "a", "bad_words": ["x"]}), AUTH, 400, "bad_words", "unsupported_value"),
    (CMPL, raw({"model": M, "prompt": "a", "truncate_prompt_tokens": 8}), AUTH, 400, "truncate_prompt_tokens",
     "unsupported_value"),
    (CMPL, raw({"model": M, "prompt": "a", "stream": True, "max_tokens": 0}), AUTH, 400, "max_tokens",
     "invalid_value"),  # a streaming request is refused before any event, as a plain 400
    (CMPL, raw({"model": M, "prompt": "a" * (2**20)}), AUTH, 413, None, "body_too_large"),
    (CHAT, raw({"model": M, "messages": []}), AUTH, 400, "messages", "too_short"),
    (CHAT, raw({"model": M, "messages": [{"role": "wizard", "content": "x"}]}), AUTH, 400, "messages[0].role",
     "invalid_value"),
    (CHAT, raw({"model": M, "messages": [{"content": "x"}]}), AUTH, 400, "messages[0].role", "missing"),
    (CHAT, raw({"model": M, "messages": [{"role": "user", "content": "x" * 200}]}), AUTH, 400, "messages",
     "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "max_completion_tokens": -3}), AUTH, 400, "max_completion_tokens",
     "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "logprobs": True, "top_logprobs": 50}), AUTH, 400, "top_logprobs",
     "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "top_logprobs": 2}), AUTH, 400, "top_logprobs", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tools": [{"type": "function"}]}), AUTH, 400, "tools[0].function",
     "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}), AUTH,
     400, "tools[0].function.name", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}), AUTH, 400, "tools[0].function.parameters", "invalid_value"),
    # Not JSON Schema, with tool_choice auto (no grammar is built): refused as OpenAI does, not taken.
    (CHAT, raw({"model": M, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]}), AUTH, 400,
     "tools[0].function.parameters", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                              "function": {"name": "nope"}}}),
     AUTH, 400, "tool_choice", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tool_choice": "required"}), AUTH, 400, "tool_choice", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "tools": TOOLS, "parallel_tool_calls": "yes"}), AUTH, 400,
     "parallel_tool_calls", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "chat_template_kwargs": {"thinking": "yes"}}), AUTH, 400,
     "chat_template_kwargs.thinking", "invalid_value"),
    (CHAT, raw({"model": M, "messages": USER, "chat_template_kwargs": {"messages": []}}), AUTH, 400,
     "chat_template_kwargs.messages", "invalid_value"),
    (CHAT, raw({"model": M, "messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}), AUTH, 400,
     "messages[0].tool_calls[0]", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "logit_bias": {"99999": 5}}), AUTH, 400, "logit_bias", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "logit_bias": {"5": 101}}), AUTH, 400, "logit_bias", "invalid_value"),
    (CMPL, raw({"model": M, "prompt": "a", "logit_bias": {"five": 1}}), AUTH, 400, "logit_bias", "invalid_value"),
    (TOKENIZE, raw({"prompt": "a", "messages": USER}), AUTH, 400, "prompt", "invalid_value"),
    (DETOKENIZE, raw({"tokens": [1, 10**6]}), AUTH, 400, "tokens", "invalid_value"),
    (TOKENIZE, raw({"prompt": "a"}), {}, 401, None, "invalid_api_key"),
    (CHAT, raw({"model": M, "messages": USER}), {}, 401, None, "invalid_api_key"),
    (CHAT, raw({"model": M, "messages": USER}), {"Authorization": "Bearer sk-nope"}, 401, None, "invalid_api_key"),
]


def test_bad_requests_get_4xx_bodies_and_the_server_stays_up(server):
    url, engine = server
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body, headers, status, param, code in CASES:
            r = http.post(path, content=body, headers={"Content-Type": "application/json", **headers})
            case = f"{path} {body[:60]!r} -> {r.status_code} {r.text[:200]}"
            assert r.status_code == status, case
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, case
            assert (error["param"], error["code"]) == (param, code), case
            assert error["message"] and (param is None or param in error["message"]), case
            assert error["type"] == "invalid_request_error", case

        assert http.get("/v1/nope", headers=AUTH).json()["error"]["code"] == "not_found"
        r = http.get(CMPL, headers=AUTH)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"

        r = http.post(CMPL, headers=AUTH, json={"model": M, "prompt": "still alive", "max_tokens": 4,
                                                "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        neutral = {"min_tokens": 0, "repetition_penalty": 1.0, "use_beam_search": False, "bad_words": [],
                   "length_penalty": 1}  # vLLM's defaults, as some clients send them: accepted
        r = http.post(CMPL, headers=AUTH, json={"model": M, "prompt": "still alive", "max_tokens": 4,
                                                "ignore_eos": True, **neutral})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").json() == {"status": "ok"}
    assert engine.is_running and engine.stats().num_running == engine.stats().num_waiting == 0
