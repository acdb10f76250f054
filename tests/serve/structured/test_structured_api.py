"""Structured outputs through the official `openai` SDK against a real server: OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*` extras, streaming, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from deltamoe.serve.engine.config import EngineConfig

M = "tiny"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "who?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, helpers):
    config = EngineConfig(cache_memory="16MiB", max_model_len=1024)  # forced tool calls: long prompts and outputs
    with helpers.openai_server(tmp_path_factory.mktemp("ckpt"), config, max_position_embeddings=1024) as client:
        yield client


def test_chat_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=M, messages=USER, response_format=fmt, temperature=1.0, seed=3)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model=M, messages=USER, response_format=fmt, temperature=1.0, seed=3,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content  # same seed, same tokens, streamed


def test_completion_vllm_extras(client):
    r = client.completions.create(model=M, prompt="a", max_tokens=40, extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=M, prompt="a", max_tokens=40, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[a-c]{2}[0-9]"}})
    assert len(r.choices[0].text) == 3 and r.choices[0].text[2].isdigit()
    r = client.completions.create(model=M, prompt="a", max_tokens=100, seed=2,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_deep_ref_chains_and_rule_chains_compile_on_big_stacks(client):
    """llguidance recurses once per $ref link or rule it follows: 3,000 links overflowed an 8 MiB thread
    stack and killed the server (a segfault, here this test process). They compile on the big-stack
    threads; the output follows the chain to its end."""
    n = 3000
    schema = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}, "$ref": "#/$defs/d0"}
    schema["$defs"][f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    r = client.completions.create(model=M, prompt="a", max_tokens=8, extra_body={"guided_json": schema})
    assert r.choices[0].text.isdigit() and r.choices[0].finish_reason == "stop"
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(n))
    r = client.completions.create(model=M, prompt="a", max_tokens=8,
                                  extra_body={"guided_grammar": f"start: r0\n{rules}\nr{n}: \"xy\""})
    assert r.choices[0].text == "xy"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"yaml": "x"}}}, "structured_outputs.yaml"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_json": False}}, "guided_json"),  # admits no value
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),
])
def test_bad_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=M, messages=USER, **body)
    assert e.value.status_code == 400 and e.value.param == param


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_comes_back_as_parsed_tool_calls(client, stream):
    """A named tool_choice: the grammar forces a Kimi tool-call section (structured/tool_call.py) and the
    chat parser (api/tool_parser.py) turns it into `tool_calls` whose arguments validate, even from
    random weights that never learned to call a tool."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=M, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=1.0, seed=5,
                  max_tokens=400)  # the byte tokenizer spells Kimi's markers out: ~170 tokens of section
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                for d in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = chunk.choices[0].finish_reason or finish
        got = list(calls.values())
    else:
        r = client.chat.completions.create(**kwargs)
        finish = r.choices[0].finish_reason
        got = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and [c["name"] for c in got] == ["get_weather"]
    jsonschema.validate(json.loads(got[0]["arguments"]), WEATHER["function"]["parameters"])


def test_with_thinking_the_constraint_waits_for_the_end_of_the_reasoning(client):
    """The template opens `<think>`: the reasoning is free text (here 'y' pushed by logit_bias, which the
    choice grammar would refuse after one 'y'), and the constraint holds after `</think>` only."""
    r = client.chat.completions.create(model=M, messages=USER, max_tokens=4, temperature=0,
                                       logit_bias={str(ord("y")): 100},
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]},
                                                   "chat_template_kwargs": {"thinking": True}})
    message = r.choices[0].message
    assert message.reasoning_content == "yyyy" and not message.content and r.choices[0].finish_reason == "length"


def test_a_grammar_that_fails_mid_output_is_an_error_not_a_finished_answer(client):
    """`a{99999999}` compiles, then exceeds llguidance's limits once matching starts: the request fails
    with a 400 naming the field, never 'stop' with a text the regex does not match."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=M, prompt="a", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "a{99999999}"}})
    assert "structured_outputs.regex" in e.value.message and "grammar failed" in e.value.message
    with pytest.raises(openai.APIError, match="grammar failed"):  # streamed: before or in the stream
        for _ in client.completions.create(model=M, prompt="a", max_tokens=8, stream=True,
                                           extra_body={"structured_outputs": {"regex": "a{99999999}"}}):
            pass
