"""Kimi tool-call and reasoning parsers: the rule on hand-written cases, and the incremental forms
held to the plain references on random (often hostile) texts split at random into deltas."""

from __future__ import annotations

import json
import random

import pytest

from deltamoe.serve.api.chat_output import AssistantOutputParser, MessageDelta
from deltamoe.serve.api.reasoning_parser import ReasoningDelta, ReasoningParser, split_reasoning
from deltamoe.serve.api.tool_parser import ToolCall, ToolCallParser, ToolDelta, parse_tool_calls

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(id_: str, args: str) -> str:
    return f"{CB}{id_}{AB}{args}{CE}"


def stream_tools(text: str, cuts: list[int], parallel: bool = True) -> ToolDelta:
    p, out = ToolCallParser(parallel), ToolDelta()
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out += p.feed(text[a:b])
    out += p.finish()
    return out


def stream_reasoning(text: str, cuts: list[int], starts_inside: bool) -> ReasoningDelta:
    p, out = ReasoningParser(starts_inside), ReasoningDelta()
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        d = p.feed(text[a:b])
        out.reasoning += d.reasoning
        out.content += d.content
    d = p.finish()
    return ReasoningDelta(out.reasoning + d.reasoning, out.content + d.content)


def random_cuts(rng: random.Random, n: int) -> list[int]:
    return sorted(rng.sample(range(1, n), rng.randint(0, min(n - 1, 12)))) if n > 1 else []


def test_calls_and_content():
    text = "Let me check." + SB + call("functions.get_weather:0", ' {"city": "Paris"} ') + \
        call("functions.get_time:1", '{"tz": "CET"}') + SE
    out = parse_tool_calls(text)
    assert out.content == "Let me check."
    assert out.calls == [ToolCall(0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                         ToolCall(1, "functions.get_time:1", "get_time", '{"tz": "CET"}')]
    assert parse_tool_calls(text, parallel_tool_calls=False).calls == out.calls[:1]
    # A bare NAME:IDX id (some peers accept it), and the singular section marker vLLM also reads.
    bare = parse_tool_calls("<|tool_call_section_begin|>" + call("f-1:0", "{}") + "<|tool_call_section_end|>")
    assert bare == ToolDelta("", [ToolCall(0, "f-1:0", "f-1", "{}")])
    assert parse_tool_calls("no tools here") == ToolDelta("no tools here", [])


@pytest.mark.parametrize("body, content", [
    (call("functions.f:0", '{"a": 1'), call("functions.f:0", '{"a": 1')),  # invalid JSON
    (call("functions.f:0", "[1, 2]"), call("functions.f:0", "[1, 2]")),  # not an object
    (call("functions.f", "{}"), call("functions.f", "{}")),  # no :IDX
    (f"{CB}functions.f:0{{}}{CE}", f"{CB}functions.f:0{{}}{CE}"),  # no argument marker
    (f"{CB}functions.f:0{AB}{{}}", f"{CB}functions.f:0{AB}{{}}"),  # cut off by the end of generation
])
def test_malformed_calls_degrade_to_their_raw_text(body, content):
    assert parse_tool_calls("A" + SB + body) == ToolDelta("A" + content, [])
    assert stream_tools("A" + SB + body, []) == ToolDelta("A" + content, [])


def test_a_call_cut_by_the_next_one_degrades_and_the_next_still_counts():
    text = SB + f"{CB}functions.f:0{AB}{{\"a\"" + call("functions.g:1", "{}") + SE + " after"
    out = parse_tool_calls(text)
    assert out.content == f"{CB}functions.f:0{AB}{{\"a\"" + " after"
    assert out.calls == [ToolCall(0, "functions.g:1", "g", "{}")]


def test_an_unclosed_section_keeps_its_complete_calls():
    out = parse_tool_calls(SB + call("functions.f:0", "{}") + "\n")
    assert out == ToolDelta("", [ToolCall(0, "functions.f:0", "f", "{}")])


PIECES = ["Hi ", "x", " ", "\n", "{", "}", '"', ":0", "functions.", "get_weather", ":1", "<", "|", "<|tool_",
          '{"city": "Paris"}', '{"a": [1, {"b": null}]}', "[1]", SB, SE, CB, AB, CE, "<|tool_call_section_begin|>",
          "<|tool_call_section_end|>", "<think>", "</think>", "</th", "<thi", "é", "🙂"]


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.4:  # mostly well formed: content, reasoning, calls
        calls = "".join(call(f"functions.{rng.choice(['f', 'get_weather'])}:{i}", rng.choice(PIECES[14:17]))
                        for i in range(rng.randint(0, 3)))
        think = rng.choice(["", "<think>", "<think>hm</think>", "plan</think>"])
        return think + rng.choice(["", "ok "]) + SB + calls + rng.choice([SE, ""]) + rng.choice(["", "bye"])
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))


def test_streaming_equals_the_reference_on_random_splits():
    rng = random.Random(0)
    for i in range(800):
        text = random_text(rng)
        cuts = random_cuts(rng, len(text))
        for parallel in (True, False):
            assert stream_tools(text, cuts, parallel) == parse_tool_calls(text, parallel), (text, cuts)
        if i % 8 == 0:  # character by character
            assert stream_tools(text, list(range(1, len(text)))) == parse_tool_calls(text)
        for inside in (True, False):
            assert stream_reasoning(text, cuts, inside) == split_reasoning(text, inside), (text, cuts, inside)
        # Tool calls are JSON objects whatever the text was.
        for c in parse_tool_calls(text).calls:
            assert isinstance(json.loads(c.arguments), dict)


def test_reasoning_rule():
    assert split_reasoning("<think>a</think>b", False) == ReasoningDelta("a", "b")
    assert split_reasoning("a</think>b", True) == ReasoningDelta("a", "b")  # the prompt opened <think>
    assert split_reasoning("a</think>b", False) == ReasoningDelta("", "a</think>b")  # no section: all content
    assert split_reasoning("<think>cut by max_tokens", False) == ReasoningDelta("cut by max_tokens", "")
    # A tool-call section ends reasoning and stays for the tool parser.
    assert split_reasoning("hm" + SB + "x", True) == ReasoningDelta("hm", SB + "x")


def test_assistant_parser_joins_both_and_counts_reasoning_tokens():
    p = AssistantOutputParser(ReasoningParser(starts_inside=True), ToolCallParser())
    deltas = [p.feed(piece, 1) for piece in ["I should ", "look</th", "ink>Sure.", SB, call("functions.f:0", "{}"), SE]]
    deltas.append(p.finish())
    total = MessageDelta()
    for d in deltas:
        total += d
    assert total == p.message == MessageDelta("I should look", "Sure.", [ToolCall(0, "functions.f:0", "f", "{}")])
    assert p.reasoning_tokens == 3  # pieces that arrived while the section was open, up to the one closing it


def test_chat_formatter_streams_what_it_answers_in_openai_shapes():
    """The formatter with a parser: chunks parse as the SDK's ChatCompletionChunk and add up to the response."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from deltamoe.serve.api.chat_output import ChatChoiceParser
    from deltamoe.serve.api.format import ChatFormatter
    from deltamoe.serve.engine.outputs import RequestOutput
    from deltamoe.tokenizers.byte import ByteTokenizer

    text = "hmm</think>Sure." + SB + call("functions.f:0", '{"x": 1}') + call("functions.g:1", "{") + SE
    rng = random.Random(1)
    cuts = random_cuts(rng, len(text))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    fmt = ChatFormatter("chatcmpl-1", "m", ByteTokenizer(), False,
                        ChatChoiceParser(ReasoningParser(starts_inside=True), ToolCallParser()))
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput("chatcmpl-1", piece, [0], None, text[:sum(map(len, pieces[:i + 1]))], 5, i + 1, 0,
                            finished=last, finish_reason="stop" if last else None)
        if (chunk := fmt.add(out)) is not None:
            chunks.append(ChatCompletionChunk.model_validate_json(chunk.model_dump_json()))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    response = ChatCompletion.model_validate_json(fmt.response().model_dump_json())
    message = response.choices[0].message
    assert (reasoning, content) == ("hmm", "Sure." + call("functions.g:1", "{")) == \
        (message.model_extra["reasoning_content"], message.content)
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in calls] == [(0, "functions.f:0", "f",
                                                                                         '{"x": 1}')]
    assert [(c.id, c.function.arguments) for c in message.tool_calls] == [("functions.f:0", '{"x": 1}')]
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason == "tool_calls"
    assert response.usage.completion_tokens_details.reasoning_tokens >= 1
