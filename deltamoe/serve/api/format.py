"""Engine outputs -> OpenAI objects: streaming chunks and whole responses, for completions and chat.

A formatter follows one request: `add(out)` takes each RequestOutput as it arrives, returns the
chunk to stream (or None when there is nothing to show yet, e.g. half of a UTF-8 character) and
keeps just enough state (text pieces, logprobs) to build the non-streaming response at the end.
"""

from __future__ import annotations

import time

from deltamoe.serve.api.chat_output import ChatChoiceParser
from deltamoe.serve.api.schemas import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                        ChatDelta, ChatLogprobs, ChatMessageOut, ChatTokenLogprob, CompletionChoice,
                                        CompletionLogprobs, CompletionResponse, PromptTokensDetails, TopLogprob, Usage)
from deltamoe.serve.engine.outputs import RequestOutput
from deltamoe.tokenizers.base import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's own text (special tokens by name) and raw bytes; a byte that is half a character shows as U+FFFD."""
    try:
        raw = tokenizer.token_bytes(token_id)
    except ValueError:  # a padded vocabulary id the tokenizer does not know
        raw = b""
    return raw.decode("utf-8", errors="replace"), raw


def prompt_logprobs_entries(tokenizer: Tokenizer, scored: list) -> list[dict | None]:
    """vLLM's `prompt_logprobs` list: None for the first prompt token (nothing precedes it), then per
    token {token id: {"logprob", "decoded_token"}} for the token itself and the top n."""
    out: list[dict | None] = [None]
    for lp in scored:
        entries = {lp.token_id: lp.logprob, **{t: v for t, v in lp.top}}
        out.append({str(t): {"logprob": v, "decoded_token": token_text(tokenizer, t)[0]} for t, v in entries.items()})
    return out


def usage_of(out: RequestOutput) -> Usage:
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                 total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


class _Formatter:
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer):
        self.id, self.model, self.tokenizer = request_id, model, tokenizer
        self.created = int(time.time())
        self.last: RequestOutput | None = None
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _track(self, out: RequestOutput) -> None:
        self.last = out
        if out.delta_text:
            self._pieces.append(out.delta_text)


class CompletionFormatter(_Formatter):
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, logprobs: bool):
        super().__init__(request_id, model, tokenizer)
        self._logprobs = CompletionLogprobs() if logprobs else None
        self._offset = 0  # characters of `text` before the current output's delta

    def add(self, out: RequestOutput) -> CompletionResponse | None:
        self._track(out)
        delta_lp = self._add_logprobs(out)
        if not (out.delta_text or delta_lp or out.finished):
            return None
        choice = CompletionChoice(text=out.delta_text, logprobs=delta_lp, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _add_logprobs(self, out: RequestOutput) -> CompletionLogprobs | None:
        """The delta's logprob lists. `text_offset` is where each token starts in the returned `text`
        (OpenAI's meaning): a token alone in its output starts where that output's text does, exactly
        (a skipped special token or half a character takes no room); several tokens in one output
        (echo, multi-step, speculative) step by their own texts within it."""
        start, room = self._offset, len(out.delta_text)
        self._offset += room
        if self._logprobs is None or not out.delta_logprobs:
            return None
        delta = CompletionLogprobs()
        within = 0
        for lp in out.delta_logprobs:
            text, _ = token_text(self.tokenizer, lp.token_id)
            top: dict[str, float] = {}
            for t, v in lp.top:  # best first; tokens that print alike (half characters) keep the best
                top.setdefault(token_text(self.tokenizer, t)[0], v)
            delta.tokens.append(text)
            delta.token_logprobs.append(lp.logprob)
            delta.top_logprobs.append(top or {text: lp.logprob})
            delta.text_offset.append(start + min(within, room))
            within += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self._logprobs, name).extend(getattr(delta, name))
        return delta

    def usage_chunk(self) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                  usage=usage_of(self.last))

    def response(self) -> CompletionResponse:
        choice = CompletionChoice(text=self.text, logprobs=self._logprobs, finish_reason=self.last.finish_reason,
                                  stop_reason=self.last.stop_reason)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage_of(self.last))


class ChatFormatter(_Formatter):
    """`parser`: splits the text into reasoning, content and tool calls (chat_output.py); None: all content."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, logprobs: bool,
                 parser: ChatChoiceParser | None = None, prompt_logprobs: bool = False):
        """`prompt_logprobs`: the request asked for them (vLLM's extension): the response's top-level
        `prompt_logprobs`, and the first stream chunk's."""
        super().__init__(request_id, model, tokenizer)
        self._logprobs: list[ChatTokenLogprob] | None = [] if logprobs else None
        self._sent_role = False
        self.parser = parser
        self._wants_prompt_logprobs = prompt_logprobs
        self._prompt_logprobs: list[dict | None] | None = None

    def add(self, out: RequestOutput) -> ChatCompletionChunk | None:
        self._track(out)
        delta_lp = self._add_logprobs(out)
        first = not self._sent_role
        if first and self._wants_prompt_logprobs:
            self._prompt_logprobs = prompt_logprobs_entries(self.tokenizer, out.prompt_logprobs or [])
        parsed = self.parser.add_output(out) if self.parser is not None else None
        if not (first or (parsed if self.parser is not None else out.delta_text) or delta_lp or out.finished):
            return None
        self._sent_role = True
        # The first chunk carries the role, as OpenAI's does; clients key the message off it.
        delta = ChatDelta(role="assistant" if first else None, content=out.delta_text) if parsed is None \
            else self.parser.delta(parsed, first)
        choice = ChatChunkChoice(delta=delta, logprobs=ChatLogprobs(content=delta_lp) if delta_lp else None,
                                 finish_reason=self._finish_reason(), stop_reason=out.stop_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   prompt_logprobs=self._prompt_logprobs if first else None)

    def _add_logprobs(self, out: RequestOutput) -> list[ChatTokenLogprob] | None:
        if self._logprobs is None or not out.delta_logprobs:
            return None
        delta = []
        for lp in out.delta_logprobs:
            text, raw = token_text(self.tokenizer, lp.token_id)
            top = [TopLogprob(token=t_text, logprob=v, bytes=list(t_raw))
                   for t, v in lp.top for t_text, t_raw in [token_text(self.tokenizer, t)]]
            delta.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw), top_logprobs=top))
        self._logprobs.extend(delta)
        return delta

    def _finish_reason(self) -> str | None:
        reason = self.last.finish_reason
        return reason if self.parser is None else self.parser.finish_reason(reason)

    def usage(self) -> Usage:
        """This choice's usage (its reasoning tokens counted when it reasons)."""
        usage = usage_of(self.last)
        return usage if self.parser is None else self.parser.usage(usage)

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage())

    def response(self) -> ChatCompletionResponse:
        logprobs = ChatLogprobs(content=self._logprobs) if self._logprobs is not None else None
        message = ChatMessageOut(content=self.text) if self.parser is None else self.parser.message_out()
        choice = ChatChoice(message=message, logprobs=logprobs,
                            finish_reason=self._finish_reason(), stop_reason=self.last.stop_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self.usage(), prompt_logprobs=self._prompt_logprobs)
