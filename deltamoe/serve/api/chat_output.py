"""One chat choice's model text -> reasoning_content, content and tool_calls, as it streams.

The reasoning parser sees the text first (reasoning comes before the answer); what it calls
content goes through the tool-call parser. Either may be off: a request without tools (or with
`tool_choice: "none"`) gets no tool parsing, a request without thinking no reasoning parsing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamoe.serve.api.reasoning_parser import ReasoningParser
from deltamoe.serve.api.schemas import (ChatDelta, ChatMessageOut, CompletionTokensDetails, FunctionCallOut,
                                        ToolCallDelta, ToolCallOut, Usage)
from deltamoe.serve.api.tool_parser import ToolCall, ToolCallParser
from deltamoe.serve.engine.outputs import RequestOutput


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: "MessageDelta") -> "MessageDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class AssistantOutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None):
        self.reasoning, self.tools = reasoning, tools
        self.message = MessageDelta()  # everything so far: the non-streaming response's message
        self.reasoning_tokens = 0  # output tokens that arrived while the reasoning section was open

    def feed(self, text: str, num_tokens: int = 0) -> MessageDelta:
        if self.reasoning is not None and self.reasoning.reasoning_open:
            self.reasoning_tokens += num_tokens
        return self._add(self.reasoning.feed(text) if self.reasoning else None, text, final=False)

    def finish(self) -> MessageDelta:
        return self._add(self.reasoning.finish() if self.reasoning else None, "", final=True)

    def _add(self, split, text: str, final: bool) -> MessageDelta:
        out = MessageDelta(reasoning=split.reasoning if split else "", content=split.content if split else text)
        if self.tools is not None:
            parsed = self.tools.feed(out.content)
            if final:
                parsed += self.tools.finish()
            out.content, out.tool_calls = parsed.content, parsed.calls
        self.message += out
        return out


# ---------------------------------------------------------------------------- as OpenAI objects
def _calls(calls: list[ToolCall]) -> list[ToolCallDelta]:
    return [ToolCallDelta(index=c.index, id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]


class ChatChoiceParser(AssistantOutputParser):
    """The parser as the chat formatter uses it: engine outputs in, delta / message / usage fields out."""

    def add_output(self, out: RequestOutput) -> MessageDelta:
        delta = self.feed(out.delta_text, len(out.delta_token_ids))
        if out.finished:
            delta += self.finish()
        return delta

    def delta(self, d: MessageDelta, first: bool) -> ChatDelta:
        # The first chunk carries content "" like OpenAI's, so clients see a content key from the start.
        return ChatDelta(role="assistant" if first else None, content=d.content or ("" if first else None),
                         reasoning_content=d.reasoning or None, tool_calls=_calls(d.tool_calls) or None)

    def message_out(self) -> ChatMessageOut:
        m = self.message
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in m.tool_calls]
        return ChatMessageOut(content=m.content or (None if calls or m.reasoning else ""),
                              reasoning_content=m.reasoning if self.reasoning is not None else None,
                              tool_calls=calls or None)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.message.tool_calls else reason

    def usage(self, usage: Usage) -> Usage:
        if self.reasoning is None:
            return usage
        return usage.model_copy(update={"completion_tokens_details":
                                        CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens)})
