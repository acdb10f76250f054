"""Incremental detokenization: UTF-8 safe, stop strings that may span tokens, nothing emitted past a stop.

Tokens arrive as raw bytes (`Tokenizer.token_bytes`); an incremental UTF-8 decoder holds back an
incomplete multi-byte character until its last byte arrives. Text that could still become the
start of a stop string is held back too, so a client never sees text that a stop later removes.
"""

from __future__ import annotations

import codecs

from deltamoe.tokenizers.base import Tokenizer


class IncrementalDetokenizer:
    """`stream=False` (offline generation without stop strings: nobody reads text before the end)
    keeps the token ids and decodes them once in `flush`; the final text is the same."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, stream: bool = True):
        self._tokenizer = tokenizer
        self._deferred: list[int] | None = None if stream or stop else []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = set(tokenizer.special_tokens.values()) if skip_special_tokens else set()
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self.text = ""  # decoded so far (the final output once finished)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None  # the stop string that matched

    def push(self, token_id: int) -> str:
        """Add one token; return the newly safe text (possibly empty)."""
        if self.stopped_by is not None:
            return ""
        if self._deferred is not None:
            self._deferred.append(token_id)
            return ""
        return self._add(self._decoder.decode(self._bytes(token_id)))

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._skip:
            return b""
        try:
            return self._tokenizer.token_bytes(token_id)
        except ValueError:  # a model vocabulary padded past the tokenizer's: such ids have no text
            return b""

    def flush(self) -> str:
        """At the end of generation: release held-back text (an unfinished character becomes U+FFFD)."""
        delta = ""
        if self._deferred:
            pending, self._deferred = b"".join(map(self._bytes, self._deferred)), []
            delta = self._add(self._decoder.decode(pending))
        if self.stopped_by is not None:  # _add already released everything up to the stop
            return delta
        delta += self._add(self._decoder.decode(b"", final=True))
        delta += self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def _release(self) -> str:
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def _add(self, new: str) -> str:
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, len(self.text) - longest + 1)  # earlier starts were already checked
        self.text += new
        hit = min(((i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0), default=None)
        if hit is not None:
            i, s = hit
            self.text = self.text[: i + (len(s) if self._include_stop else 0)]
            self.stopped_by = s
            return self._release()
        end = len(self.text) - self._partial_stop_suffix()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
