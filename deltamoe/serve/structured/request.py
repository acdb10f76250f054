"""The request fields that ask for structured output -> one Constraint, with errors naming the field.

Accepted, at most one per request:
- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", "strict"}}.
- vLLM's current names: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"}.
- vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- A chat's `tool_choice` "required" or a named function (tool_call.py), which forces a tool call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from deltamoe.errors import RequestError
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.structured.constraint import (COMPILE_TIMEOUT_S, Constraint, choice_constraint, compile_pool,
                                                  json_object_constraint, json_schema_constraint, lark_constraint,
                                                  regex_constraint)
from deltamoe.tokenizers.base import Tokenizer

_VLLM_KINDS: dict[str, Callable[[Any, str], Constraint]] = {
    "json": lambda v, f: json_schema_constraint(_parsed_json(v, f), f),
    "regex": regex_constraint,
    "choice": choice_constraint,
    "grammar": lark_constraint,
}
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_from_request(req: Any, tokenizer: Tokenizer) -> Constraint | None:
    """The one constraint a completions or chat request asks for (None: free text)."""
    found: list[Constraint] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        found += _from_response_format(response_format)
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        found += _from_structured_outputs(structured)
    for name, kind in _LEGACY.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(_VLLM_KINDS[kind](value, name))
    tool_choice = getattr(req, "tool_choice", None)
    if tool_choice not in (None, "none", "auto"):
        from deltamoe.serve.structured.tool_call import history_call_ids, tool_call_constraint

        parallel = getattr(req, "parallel_tool_calls", None) is not False
        earlier = len(history_call_ids(getattr(req, "messages", None) or []))
        found.append(tool_call_constraint(getattr(req, "tools", None) or [], tool_choice, parallel, tokenizer,
                                          first_index=earlier))
    if len(found) > 1:
        raise RequestError(f"{' and '.join(c.field for c in found)} both constrain the output; send one",
                           field=found[1].field)
    return found[0] if found else None


def _from_response_format(rf: Any) -> list[Constraint]:
    if not isinstance(rf, dict):
        raise RequestError("expected an object with a 'type'", field="response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [json_object_constraint("response_format")]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("expected {'name': ..., 'schema': {...}}", field="response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"expected a boolean, got {strict!r}", field="response_format.json_schema.strict")
        return [json_schema_constraint(spec["schema"], "response_format.json_schema.schema", strict=bool(strict))]
    raise RequestError(f"expected 'text', 'json_object' or 'json_schema', got {kind!r}", field="response_format.type")


def _from_structured_outputs(so: Any) -> list[Constraint]:
    if not isinstance(so, dict):
        raise RequestError("expected an object", field="structured_outputs")
    out: list[Constraint] = []
    for key, value in so.items():
        if value is None or value is False:
            continue
        field = f"structured_outputs.{key}"
        if key == "json_object":
            out.append(json_object_constraint(field))
        elif key in _VLLM_KINDS:
            out.append(_VLLM_KINDS[key](value, field))
        else:
            raise RequestError(f"unknown kind {key!r}; expected one of json, regex, choice, grammar, json_object",
                               field=field)
    return out


def _parsed_json(value: Any, field: str) -> Any:
    """vLLM accepts a schema as an object or as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"not valid JSON ({e})", field=field) from None
    return value


async def constrain(params: SamplingParams, req: Any, tokenizer: Tokenizer) -> None:
    """Set `params.structured` from the request and compile it off the event loop (the engine then
    finds it in the compile cache); a bad schema or grammar raises RequestError naming its field."""
    # Building the grammar (a schema's conversion: seconds for a large one, and as deep as its $ref
    # chains) runs on the compile threads too, not on the event loop every client shares.
    built = asyncio.wrap_future(compile_pool().submit(constraint_from_request, req, tokenizer))
    try:
        params.structured = await asyncio.wait_for(built, COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
        raise RequestError(f"the structured-output request did not convert within {COMPILE_TIMEOUT_S:g} s; "
                           "simplify it", field=_asked_field(req)) from None
    if params.structured is not None:
        await asyncio.to_thread(params.structured.compile, tokenizer)


def _asked_field(req: Any) -> str:
    for name in ("response_format", "structured_outputs", *_LEGACY, "tool_choice"):
        if getattr(req, name, None) not in (None, "none", "auto"):
            return name
    return "response_format"
