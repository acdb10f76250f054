"""Structured outputs: decoding constrained by a grammar (JSON schema, regex, choice, Lark, tool calls).

`constraint.py` turns what a request asks for into one grammar and compiles it, in bounded time, with
llguidance (docs/serving.md says why that library); `matcher.py` follows one sequence through the
grammar and hands the sampler its mask of allowed tokens; `request.py` reads the OpenAI / vLLM
request fields; `tool_call.py` builds the grammar of a Kimi tool-call section.
"""
