"""The grammar of a Kimi tool-call section, for `tool_choice` "required" or a named function.

Kimi writes tool calls as

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json
    args}<|tool_call_end|>...<|tool_calls_section_end|>

Constraining decoding to that shape, with each call's arguments held to its function's parameter
schema, makes the call parse and validate whatever the weights (vLLM does the same for these
`tool_choice` values). The markers are the tokenizer's special tokens where it has them (Kimi's
tokenizers do); a tokenizer without them (the byte tokenizer) spells them as text.
"""

from __future__ import annotations

import json
from typing import Any

from deltamoe.errors import RequestError
from deltamoe.serve.structured.constraint import JSON_OPTIONS, Constraint, json_schema_constraint, lark_constraint
from deltamoe.tokenizers.base import Tokenizer

MAX_PARALLEL_CALLS = 16  # "required" with parallel calls: a section holds 1..16 calls
MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def tool_call_constraint(tools: list[Any], tool_choice: Any, parallel_tool_calls: bool = True,
                         tokenizer: Tokenizer | None = None) -> Constraint:
    """`tool_choice` "required": one or more calls (one when not `parallel_tool_calls`) to any of
    `tools`; {"type": "function", "function": {"name": N}}: exactly one call to N."""
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise RequestError("tool_choice 'required' needs at least one tool", field="tools")
        chosen, many = functions, parallel_tool_calls
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise RequestError(f"names the function {name!r}, which is not among tools "
                               f"({', '.join(functions) or 'none'})", field="tool_choice")
        chosen, many = {name: functions[name]}, False
    else:
        raise RequestError("expected 'none', 'auto', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", field="tool_choice")
    return lark_constraint(tool_call_lark(chosen, many, special_markers(tokenizer)), "tool_choice")


def tool_call_lark(functions: dict[str, dict], many: bool, special: bool) -> str:
    """A Lark grammar: one section of calls to `functions`, each argument object under its schema."""
    begin, end, call_begin, args_begin, call_end = (m if special else json.dumps(m) for m in MARKERS)
    lines = [f"start: {begin} call{f'{{1,{MAX_PARALLEL_CALLS}}}' if many else ''} {end}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, schema) in enumerate(functions.items()):
        lines.append(f"call_{i}: {call_begin} {json.dumps(f'functions.{name}:')} index {args_begin} args_{i} {call_end}")
        lines.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    lines.append("index: /[0-9]{1,4}/")
    return "\n".join(lines)


def special_markers(tokenizer: Tokenizer | None) -> bool:
    """Whether the tokenizer has every Kimi tool-call marker as a special token."""
    return tokenizer is not None and all(m in tokenizer.special_tokens for m in MARKERS)


def _functions(tools: Any) -> dict[str, dict]:
    """{name: parameter schema} from OpenAI `tools`, each schema checked (a bad one is a 400 naming it)."""
    if not isinstance(tools, list):
        raise RequestError("expected a list of tools", field="tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError("expected {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
                               field=f"tools[{i}]")
        schema = fn.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict):
            raise RequestError("expected a JSON schema object", field=f"tools[{i}].function.parameters")
        # Converted alone first, so a schema the grammar library refuses is a 400 naming this tool.
        json_schema_constraint({"type": "object", **schema}, f"tools[{i}].function.parameters")
        out[name] = {"type": "object", **schema}  # the arguments are an object, typed or not in the schema
    return out

