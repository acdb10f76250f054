"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, with errors naming the field.

`tool_choice`: "auto" (the default with tools: the model decides, its tool-call section is
parsed), "none" (the default without tools: output is plain content), "required" (at least
one call) or {"type": "function", "function": {"name": ...}} (that function). The last two
are enforced by constrained decoding: serve/structured/ builds the grammar (`tool_call_constraint`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from deltamoe.errors import RequestError
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.structured.constraint import check_schema

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("auto", "none", "required")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as the client sent them (the template renders them)
    choice: str  # auto | none | required | function
    function: str | None  # the function tool_choice names
    parallel: bool

    @property
    def parse_calls(self) -> bool:
        """Whether the output's tool-call section becomes `tool_calls`."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest:
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise _bad("tools", "expected a list of {type: 'function', function: {name, description, parameters}}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"{where}.type", "only tools of type 'function' are supported")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise _bad(f"{where}.function", "expected an object with name, description and parameters")
        name = f.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", f"expected 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}")
        if name in names:
            raise _bad(f"{where}.function.name", f"{name!r} is defined twice")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise _bad(f"{where}.function.description", "expected a string")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise _bad(f"{where}.function.parameters", "expected a JSON schema object")
        if isinstance(f.get("parameters"), dict) and f["parameters"].get("type", "object") != "object":
            # A call's arguments are a JSON object (as OpenAI requires of the schema).
            raise _bad(f"{where}.function.parameters",
                       f"expected a schema of type 'object' (the call's arguments), got type {f['parameters']['type']!r}")
        if isinstance(f.get("parameters"), dict):  # whatever tool_choice is, as OpenAI checks them
            try:
                check_schema(f["parameters"], f"{where}.function.parameters")
            except RequestError as e:
                raise _bad(f"{where}.function.parameters", str(e)) from None
        names.append(name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", f"expected a boolean, got {parallel_tool_calls!r}")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None:
        return ToolRequest(tools, "auto" if tools else "none", None, parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise _bad("tool_choice", f"expected one of {CHOICES} or a function, got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise _bad("tool_choice", f"{tool_choice!r} needs `tools`")
        return ToolRequest(tools, tool_choice, None, parallel)
    f = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise _bad("tool_choice", "expected 'auto', 'none', 'required' or {type: 'function', function: {name}}")
    if f["name"] not in names:
        raise _bad("tool_choice", f"names the function {f['name']!r}, which is not in `tools` "
                                  f"({', '.join(names) or 'none given'})")
    return ToolRequest(tools, "function", f["name"], parallel)
