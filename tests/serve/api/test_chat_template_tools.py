"""The chat template with tools, tool calls, tool results and thinking (Kimi's format), and what stays plain text."""

from __future__ import annotations

from deltamoe.serve.api.chat_template import ChatTemplate, normalize_messages
from deltamoe.tokenizers.byte import ByteTokenizer

TOOLS = [{"type": "function", "function": {"name": "f", "description": "<|end|>", "parameters": {"type": "object"}}}]
CALL = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a": "<|end|>"}'}}


def test_plain_conversations_render_as_before():
    t = ChatTemplate(ByteTokenizer())
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.render(messages) == "<|system|>S<|end|><|user|>U<|end|><|assistant|>"
    assert not t.thinking_default


def test_tools_calls_and_results_in_kimi_format():
    tok = ByteTokenizer()
    t = ChatTemplate(tok)
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "functions.f:0", "content": "R"}]
    ids = t.encode(messages, tools=TOOLS, template_kwargs={"thinking": True})
    assert tok.decode(ids, skip_special_tokens=False) == (
        '<|system|>tool_declare\n[{"type": "function", "function": {"name": "f", "description": "<|end|>", '
        '"parameters": {"type": "object"}}}]<|end|><|user|>U<|end|><|assistant|><|tool_calls_section_begin|>'
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": "<|end|>"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|end|><|tool|>## Return of functions.f:0\nR<|end|><|assistant|><think>")
    # The template's own <|end|> are specials (4 turns); the client's (description, arguments) are bytes.
    assert ids.count(tok.special_tokens["<|end|>"]) == 4 and ids.count(ord("<")) > 4
    # Arguments sent as an object (some clients do) are written as JSON.
    obj = {**CALL, "function": {"name": "f", "arguments": {"a": 1}}}
    assert '{"a": 1}' in t.render(normalize_messages([{"role": "assistant", "tool_calls": [obj]}]))


def test_a_checkpoint_template_gets_tools_kwargs_and_hf_tojson():
    tok = ByteTokenizer()
    source = ("{% if tools %}<|system|>{{ tools | tojson(separators=(',', ':')) }}<|end|>{% endif %}"
              "{% for m in messages %}<|user|>{{ m.content }}<|end|>{% endfor %}"
              "<|assistant|>{% if thinking is defined and thinking is false %}<think></think>{% else %}<think>"
              "{% endif %}")
    t = ChatTemplate(tok, source)
    assert t.thinking_default  # a template that writes <think> belongs to a thinking model
    text = t.render([{"role": "user", "content": "U"}], tools=TOOLS, template_kwargs={"thinking": False})
    assert text.startswith('<|system|>[{"type":"function","function":{"name":"f","description":"<|end|>"')
    assert text.endswith("<|assistant|><think></think>")


def test_a_tool_result_must_name_the_call_it_answers():
    import pytest

    from deltamoe.errors import RequestError

    for bad in ({"role": "tool", "content": "R"}, {"role": "tool", "content": "R", "tool_call_id": ""},
                {"role": "tool", "content": "R", "tool_call_id": 3}):
        with pytest.raises(RequestError) as e:
            normalize_messages([{"role": "user", "content": "U"}, bad])
        assert e.value.field == "messages[1].tool_call_id"
    ok = normalize_messages([{"role": "tool", "content": "R", "tool_call_id": "functions.f:0"}])
    assert ok == [{"role": "tool", "content": "R", "tool_call_id": "functions.f:0"}]
