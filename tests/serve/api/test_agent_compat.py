"""What agent frameworks send and expect beyond the basics (found by driving the server with the
`openai` SDK as an agent would): the `developer` role, refusal parts sent back, OpenAI-style call
ids in the history, tool-call ids that never repeat, and `continue_final_message` (an assistant
prefill the output continues)."""

from __future__ import annotations

import openai
import pytest

from deltamoe.errors import RequestError
from deltamoe.config import load_preset
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.tool_parser import ToolCallParser, parse_tool_calls
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.structured.tool_call import history_call_ids, tool_call_constraint
from deltamoe.tokenizers.byte import ByteTokenizer

M = "tiny"
TEMPLATE = ChatTemplate(ByteTokenizer())
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
    "additionalProperties": False}}}]
CALL = '<|tool_call_begin|>{id}<|tool_call_argument_begin|>{{"city":"Oslo"}}<|tool_call_end|>'


def text(messages, **kw) -> str:
    return ByteTokenizer().decode(TEMPLATE.encode(messages, **kw), skip_special_tokens=False)


def test_developer_is_system_and_a_refusal_part_is_text():
    assert text([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]) == \
        text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    refused = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]
    assert "<|assistant|>I can't.<|end|>" in text(refused)
    with pytest.raises(RequestError) as e:  # a user does not send refusals
        text([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert e.value.field == "messages[0].content"


def test_openai_style_call_ids_are_written_in_kimis_form_results_too():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                   {"id": "functions.get_weather:1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}]
    rendered = text(history)
    assert "call_abc" not in rendered  # the model would see neither the function's name nor an index
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in rendered
    assert "## Return of functions.get_weather:0\nsunny" in rendered
    assert history_call_ids(history) == ["functions.get_weather:0", "functions.get_weather:1"]


def test_a_repeated_call_id_is_renamed_by_both_parsers():
    output = ("<|tool_calls_section_begin|>" + CALL.format(id="functions.get_weather:0") * 2
              + CALL.format(id="functions.get_weather:3") + "<|tool_calls_section_end|>")
    earlier = frozenset({"functions.get_weather:3"})
    whole = parse_tool_calls(output, history_ids=earlier)
    assert [c.id for c in whole.calls] == ["functions.get_weather:0", "functions.get_weather:4",
                                           "functions.get_weather:5"]
    parser = ToolCallParser(history_ids=earlier)
    streamed = [c.id for i in range(0, len(output), 7) for c in parser.feed(output[i:i + 7]).calls]
    assert streamed == [c.id for c in whole.calls]


def test_forced_calls_are_numbered_from_the_conversations_count():
    tokenizer = ByteTokenizer()
    matcher = tool_call_constraint(TOOLS, "required", True, tokenizer, first_index=2).compile(tokenizer)
    good = ("<|tool_calls_section_begin|>" + CALL.format(id="functions.get_weather:2")
            + CALL.format(id="functions.get_weather:3") + "<|tool_calls_section_end|>")
    assert matcher.validate_tokens(tokenizer.encode(good)) == len(tokenizer.encode(good))
    for bad_id in ("functions.get_weather:0", "functions.get_weather:2"):  # stale, or repeated
        bad = good.replace("functions.get_weather:3", bad_id)
        assert matcher.validate_tokens(tokenizer.encode(bad)) < len(tokenizer.encode(bad))


@pytest.fixture(scope="module")
def client(tmp_path_factory, helpers):
    config = EngineConfig(cache_memory="2MiB", max_model_len=1536)  # byte tokens: a call is ~130 of them
    with helpers.openai_server(tmp_path_factory.mktemp("ckpt"), config, max_position_embeddings=2048) as client:
        yield client


def test_forced_parallel_calls_never_share_an_id(client):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "user", "content": "and again?"}]
    for seed in range(4):
        r = client.chat.completions.create(model=M, messages=history, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=1.0, seed=seed)
        ids = [c.id for c in r.choices[0].message.tool_calls or []]
        assert ids and ids == [f"functions.get_weather:{1 + k}" for k in range(len(ids))], ids


def test_continue_final_message_leaves_the_last_turn_open(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the"}]
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{base}/tokenize", json={"model": M, "messages": messages, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()["tokens"]
    assert ByteTokenizer().decode(tokens, skip_special_tokens=False).endswith("<|assistant|>Sure, the")
    r = client.chat.completions.create(model=M, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:  # a new assistant turn would follow the open one
        client.chat.completions.create(model=M, messages=messages, max_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert e.value.param == "continue_final_message"


def test_model_retrieve_stream_options_and_the_deprecated_functions(client):
    assert client.models.retrieve(M).id == M
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's and vLLM's answer: not silently dropped
        client.completions.create(model=M, prompt="x", max_tokens=2, stream_options={"include_usage": True})
    assert e.value.param == "stream_options"
    for field, value in (("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto")):
        with pytest.raises(openai.BadRequestError) as e:  # was ignored: a plain answer instead of a call
            client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body={field: value})
        assert e.value.param == field and "tool" in e.value.message


def test_cors_is_off_unless_origins_are_named(tmp_path):
    """A browser page on another origin gets no CORS grant by default; a named origin does."""
    from fastapi.testclient import TestClient

    from deltamoe.model.load import build_model
    from deltamoe.serve.api.server import build_app
    from deltamoe.serve.engine.async_engine import AsyncLLMEngine

    from deltamoe.serve.engine.llm_engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(build_model(load_preset("tiny")), config=EngineConfig(cache_memory="1MiB", max_model_len=64)))
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = TestClient(build_app(engine, M))
    assert "access-control-allow-origin" not in closed.options("/v1/completions", headers=preflight).headers
    assert "access-control-allow-origin" not in closed.get("/v1/models", headers={"Origin": "http://evil"}).headers
    open_ = TestClient(build_app(engine, M, allowed_origins=["http://localhost:3000"]))
    r = open_.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in open_.get("/v1/models", headers={"Origin": "http://evil"}).headers
