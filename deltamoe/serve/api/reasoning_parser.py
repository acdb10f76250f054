"""A `<think>`...`</think>` section at the start of model output -> `reasoning_content`, whole or streamed.

Kimi's thinking models (as vLLM's and SGLang's `kimi_k2` reasoning parsers read them) reason
first and answer after `</think>`. Where the chat template already opened the section (the
generation prompt ends with `<think>`), the output starts inside it; otherwise only an output
that itself starts with `<think>` has a reasoning section. The rule, the same for any split of
the text into deltas:
- a leading `<think>` is dropped; reasoning runs to the first `</think>` (dropped), the rest is content;
- a tool-call section begin (`<|tool_calls_section_begin|>`) also ends reasoning, and stays in the
  content for the tool parser: Kimi models may call a tool straight from their reasoning;
- reasoning that never ends is all reasoning (the output was cut by max_tokens).

`split_reasoning` is the plain reference; `ReasoningParser` the incremental form, held to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deltamoe.serve.api.tool_parser import SECTION_BEGIN, first_marker, partial_marker_len
from deltamoe.serve.structured.constraint import Constraint
from deltamoe.serve.structured.tool_call import MARKERS

THINK_BEGIN, THINK_END = "<think>", "</think>"
_ENDS = (THINK_END, *SECTION_BEGIN)


def reasoning_first(constraint: Constraint) -> Constraint:
    """`constraint` for an output that starts inside the reasoning: free until the reasoning ends
    where this parser ends it. After `</think>` the grammar holds the answer. A tool-call section
    begin also ends reasoning: a forced tool call's grammar starts at it (its first tokens), so a call
    made straight from the reasoning is still the forced one; any other grammar (an answer in JSON)
    is not written by a tool-call section, so the reasoning may not begin one."""
    if constraint.field == "tool_choice":
        return dataclasses.replace(constraint, after=THINK_END, enters_at=(MARKERS[0],),
                                   blocked_before=tuple(m for m in SECTION_BEGIN if m != MARKERS[0]))
    return dataclasses.replace(constraint, after=THINK_END, blocked_before=SECTION_BEGIN)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def split_reasoning(text: str, starts_inside: bool) -> ReasoningDelta:
    """The reference: (reasoning, content) of a whole output."""
    if text.startswith(THINK_BEGIN):
        text = text[len(THINK_BEGIN):]
    elif not starts_inside:
        return ReasoningDelta(content=text)
    hit = first_marker(text, _ENDS)
    if hit is None:
        return ReasoningDelta(reasoning=text)
    i, marker = hit
    return ReasoningDelta(reasoning=text[:i], content=text[i + len(THINK_END):] if marker == THINK_END else text[i:])


class ReasoningParser:
    """Incremental form of `split_reasoning`: `feed` each delta of text, then `finish` once."""

    def __init__(self, starts_inside: bool):
        self.starts_inside = starts_inside
        self.state = "start"  # start | reasoning | content
        self._buf = ""

    @property
    def reasoning_open(self) -> bool:
        """Whether text fed now may still be reasoning (so its tokens count as reasoning tokens)."""
        return self.state == "reasoning" or (self.state == "start" and self.starts_inside)

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        if self.state == "start":
            if THINK_BEGIN.startswith(self._buf):  # could still be a leading <think>: wait
                return out
            if self._buf.startswith(THINK_BEGIN):
                self._buf, self.state = self._buf[len(THINK_BEGIN):], "reasoning"
            else:
                self.state = "reasoning" if self.starts_inside else "content"
        if self.state == "reasoning":
            hit = first_marker(self._buf, _ENDS)
            if hit is None:
                keep = partial_marker_len(self._buf, _ENDS)
                out.reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return out
            i, marker = hit
            out.reasoning = self._buf[:i]
            self._buf = self._buf[i + len(THINK_END):] if marker == THINK_END else self._buf[i:]
            self.state = "content"
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        buf, self._buf = self._buf, ""
        if self.state == "start":  # the whole output was a prefix of "<think>"
            if buf == THINK_BEGIN:
                return ReasoningDelta()
            return ReasoningDelta(reasoning=buf) if self.starts_inside else ReasoningDelta(content=buf)
        return ReasoningDelta(reasoning=buf) if self.state == "reasoning" else ReasoningDelta(content=buf)
