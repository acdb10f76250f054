"""Kimi's tool-call section in model output -> OpenAI `tool_calls`, whole or as a stream of deltas.

The format (as vLLM's and SGLang's `kimi_k2` parsers read it):

    text<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>

The rule for what is what, the same whichever way the text is split into deltas:
- text outside a section is content; the section markers and any text inside a section but
  outside a call are dropped (as the peers do);
- a call becomes a tool call when it ends (`<|tool_call_end|>`) with an id `[functions.]NAME:IDX`
  and arguments that parse as a JSON object; its id is the model's own (`functions.NAME:IDX`),
  unless that id is already taken in the conversation or the response: then `functions.NAME:K`
  with K past every index taken (agents match tool results by id);
- a malformed call (bad id, no argument marker, arguments that are not a JSON object, a call
  cut off by another marker or by the end of generation) degrades to content: its raw text,
  markers included, in its place. Never an error.
- with `parallel_tool_calls=false` only the first tool call is kept (OpenAI's contract: at most one).

Calls stream whole: a call's delta (id, name, all of its arguments) goes out when the call
ends, because only then is it known to be valid; content streams as soon as it cannot be the
start of a section marker. `parse_tool_calls` is the plain (regex) reference; the incremental
`ToolCallParser` must agree with it on every split (tests/serve/api/test_tool_parser.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from deltamoe.serve.structured.tool_call import KIMI_CALL_ID

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # the singular: vLLM accepts it too
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
CALL_ID = KIMI_CALL_ID  # one definition, shared with the history's ids (structured/tool_call.py)


@dataclass(frozen=True)
class ToolCall:
    index: int  # position in the response's tool_calls
    id: str  # the model's own id: functions.NAME:IDX
    name: str
    arguments: str  # the JSON text as generated


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: "ToolDelta") -> "ToolDelta":
        self.content += other.content
        self.calls += other.calls
        return self


def unique_call(call: ToolCall, taken: set[str]) -> ToolCall:
    """`call`, with a fresh id when the model repeated one already in the conversation or the response
    (agents match tool results by id): `functions.NAME:K`, K past every index taken. `taken` grows."""
    if call.id in taken:
        indices = [int(m.group(2)) for t in taken if (m := CALL_ID.fullmatch(t))]
        k = max(indices, default=len(taken) - 1) + 1
        while f"functions.{call.name}:{k}" in taken:
            k += 1
        call = dataclasses.replace(call, id=f"functions.{call.name}:{k}")
    taken.add(call.id)
    return call


def call_from_text(index: int, raw: str) -> ToolCall | None:
    """The text between `<|tool_call_begin|>` and `<|tool_call_end|>` as a call, or None when malformed."""
    header, marker, arguments = raw.partition(ARGUMENT_BEGIN)
    m = CALL_ID.fullmatch(header.strip())
    if not marker or m is None or ARGUMENT_BEGIN in arguments:
        return None
    arguments = arguments.strip()
    try:
        if not isinstance(json.loads(arguments), dict):
            return None
    except (ValueError, RecursionError):
        return None
    return ToolCall(index=index, id=header.strip(), name=m.group(1), arguments=arguments)


def parse_tool_calls(text: str, parallel_tool_calls: bool = True, history_ids: frozenset[str] = frozenset()) -> ToolDelta:
    """The reference: the whole output at once (see the module docstring for the rule); `history_ids`:
    the conversation's earlier call ids, which a call's id may not repeat (`unique_call`)."""
    out = ToolDelta()
    taken = set(history_ids)
    begin = "|".join(map(re.escape, SECTION_BEGIN))
    end = "|".join(map(re.escape, SECTION_END))
    # Content, then a section up to its end marker (or the end of the text); repeated.
    pos = 0
    for m in re.finditer(f"({begin})(.*?)(?:{end}|\\Z)", text, re.S):
        out.content += text[pos:m.start()]
        pos = m.end()
        body = m.group(2)
        # Inside a section: each call runs to the first of its end marker or the next call's begin.
        for c in re.finditer(f"{re.escape(CALL_BEGIN)}(.*?)({re.escape(CALL_END)}|(?={re.escape(CALL_BEGIN)})|\\Z)",
                             body, re.S):
            raw, closed = c.group(1), c.group(2) == CALL_END
            call = call_from_text(len(out.calls), raw) if closed else None
            if call is None:
                out.content += CALL_BEGIN + raw + (CALL_END if closed else "")
            elif parallel_tool_calls or not out.calls:
                out.calls.append(unique_call(call, taken))
    out.content += text[pos:]
    return out


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else None


class ToolCallParser:
    """Incremental form of `parse_tool_calls`: `feed` each delta of text, then `finish` once."""

    def __init__(self, parallel_tool_calls: bool = True, history_ids: frozenset[str] = frozenset()):
        self.parallel_tool_calls = parallel_tool_calls
        self.calls: list[ToolCall] = []
        self._taken = set(history_ids)
        self._state = "content"  # content | section | call
        self._buf = ""

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        while True:
            if self._state == "content":
                hit = first_marker(self._buf, SECTION_BEGIN)
                if hit is None:
                    keep = partial_marker_len(self._buf, SECTION_BEGIN)
                    out.content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                i, marker = hit
                out.content += self._buf[:i]
                self._buf, self._state = self._buf[i + len(marker):], "section"
            elif self._state == "section":
                hit = first_marker(self._buf, (CALL_BEGIN, *SECTION_END))
                if hit is None:  # text between calls is dropped; keep only what may start a marker
                    self._buf = self._buf[len(self._buf) - partial_marker_len(self._buf, (CALL_BEGIN, *SECTION_END)):]
                    return out
                i, marker = hit
                self._buf = self._buf[i + len(marker):]
                self._state = "call" if marker == CALL_BEGIN else "content"
            else:
                hit = first_marker(self._buf, (CALL_END, CALL_BEGIN, *SECTION_END))
                if hit is None:
                    return out
                i, marker = hit
                raw = self._buf[:i]
                if marker == CALL_END:
                    self._buf = self._buf[i + len(marker):]
                    out += self._close(raw)
                else:  # cut off by the next marker: degrade, and let the section state take the marker
                    self._buf = self._buf[i:]
                    out.content += CALL_BEGIN + raw
                self._state = "section"

    def _close(self, raw: str) -> ToolDelta:
        call = call_from_text(len(self.calls), raw)
        if call is None:
            return ToolDelta(content=CALL_BEGIN + raw + CALL_END)
        if not self.parallel_tool_calls and self.calls:
            return ToolDelta()
        call = unique_call(call, self._taken)
        self.calls.append(call)
        return ToolDelta(calls=[call])

    def finish(self) -> ToolDelta:
        """The end of generation: held-back content is content; an unfinished call degrades to content."""
        buf, state = self._buf, self._state
        self._buf, self._state = "", "content"
        if state == "content":
            return ToolDelta(content=buf)
        if state == "call":
            return ToolDelta(content=CALL_BEGIN + buf)
        return ToolDelta()
