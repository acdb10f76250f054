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
import re
from typing import Any

from deltamoe.errors import RequestError
from deltamoe.serve.structured.constraint import JSON_OPTIONS, Constraint, json_schema_constraint, lark_constraint
from deltamoe.tokenizers.base import Tokenizer

KIMI_CALL_ID = re.compile(r"(?:functions\.)?([^\s:<>]+):(\d+)")  # a Kimi call id: (name, index)
MAX_PARALLEL_CALLS = 16  # "required" with parallel calls: a section holds 1..16 calls
MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def tool_call_constraint(tools: list[Any], tool_choice: Any, parallel_tool_calls: bool = True,
                         tokenizer: Tokenizer | None = None, first_index: int = 0) -> Constraint:
    """`tool_choice` "required": one or more calls (one when not `parallel_tool_calls`) to any of
    `tools`; {"type": "function", "function": {"name": N}}: exactly one call to N. The calls' IDX are
    `first_index`, `first_index` + 1, ... (Kimi counts calls across the conversation: pass how many
    its history holds), so a response never repeats an id."""
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
    return lark_constraint(tool_call_lark(chosen, many, special_markers(tokenizer), first_index), "tool_choice")


def tool_call_lark(functions: dict[str, dict], many: bool, special: bool, first_index: int = 0) -> str:
    """A Lark grammar: one section of calls to `functions`, each argument object under its schema;
    the k-th call of the section has the id `functions.NAME:{first_index + k}`."""
    begin, end, call_begin, args_begin, call_end = (m if special else json.dumps(m) for m in MARKERS)
    slots = MAX_PARALLEL_CALLS if many else 1
    lines = [f"start: {begin} slot_0 {end}"]
    for k in range(slots):  # slot_k: the k-th call, then optionally the next slot
        lines.append(f"slot_{k}: call_at_{k}" + (f" slot_{k + 1}?" if k + 1 < slots else ""))
        lines.append(f"call_at_{k}: " + " | ".join(
            f"{call_begin} {json.dumps(f'functions.{name}:{first_index + k}')} {args_begin} args_{i} {call_end}"
            for i, name in enumerate(functions)))
    for i, schema in enumerate(functions.values()):
        lines.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    return "\n".join(lines)


def history_call_ids(messages: list[Any]) -> list[str]:
    """The ids of the tool calls in a conversation's assistant messages, as the prompt writes them:
    the client's own where it is Kimi's form (`functions.NAME:IDX`), else `functions.NAME:K` for the
    K-th call of the conversation (an OpenAI-style `call_abc` would hide the function's name from
    the model, and its index)."""
    return list(_rendered_ids(messages).values())


def foreign_call_ids(messages: list[Any]) -> dict[str, str]:
    """Client call ids not in Kimi's form -> the id the prompt writes for them (tool results too)."""
    return {raw: ours for (_, raw), ours in _rendered_ids(messages).items() if raw != ours}


def _rendered_ids(messages: list[Any]) -> dict[tuple[int, str], str]:
    out: dict[tuple[int, str], str] = {}
    for m in messages:
        m = m.model_dump() if hasattr(m, "model_dump") else m
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        for c in calls if isinstance(calls, list) else []:
            raw = c.get("id") if isinstance(c, dict) else None
            name = (c.get("function") or {}).get("name") if isinstance(c, dict) else None
            if isinstance(raw, str) and isinstance(name, str):
                k = len(out)
                out[(k, raw)] = raw if KIMI_CALL_ID.fullmatch(raw) else f"functions.{name}:{k}"
    return out


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

