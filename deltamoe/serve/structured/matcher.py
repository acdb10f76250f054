"""GrammarMatcher: one sequence's position in its grammar, the mask of tokens allowed next.

Lives on the Sequence, so it survives preemption unchanged: a preempted sequence keeps its
generated tokens and recomputes their cache, and the grammar has already consumed them. Where
the grammar allows end-of-sequence, every stop token of the request is allowed (a chat's
end-of-turn token, not only the tokenizer's EOS); where the grammar is complete, the engine ends
the sequence.
"""

from __future__ import annotations

import torch

from deltamoe.serve.structured.constraint import Constraint
from deltamoe.serve.structured.tokenizer import ll_tokenizer
from deltamoe.tokenizers.base import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarMatcher:
    def __init__(self, constraint: Constraint, tokenizer: Tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        self.field = constraint.field
        self._ll = constraint.compile(tokenizer)
        self._eos = tokenizer.eos_token_id
        self._stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self._vocab_size = vocab_size
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._ll_words = min((ll_tokenizer(tokenizer).vocab_size + 31) // 32, len(self._bitmask))
        # Before `constraint.after` (the end of the reasoning) the output is free; its text so far
        # (and token ids: an `enters_at` text is fed to the grammar as the tokens that wrote it).
        self._after, self._tokenizer, self._before, self._before_ids = constraint.after, tokenizer, "", []
        self._enters_at = constraint.enters_at
        self._blocked = [(text, _single_token(tokenizer, text)) for text in constraint.blocked_before]

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar accepts next (ids past the tokenizer's never)."""
        if self._after is not None:
            return self._free_mask()
        self._bitmask.zero_()
        self._ll.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._ll_words * 4)
        allowed = ((self._bitmask.unsqueeze(1) >> _BITS) & 1).flatten()[:self._vocab_size].bool()
        if self._ll.is_error():  # never for tokens it allowed itself; end the sequence rather than guess
            allowed.zero_()
            allowed[self._stop_ids] = True
        elif allowed[self._eos] and len(self._stop_ids):
            allowed[self._stop_ids] = True
        return allowed

    def accept(self, token: int) -> None:
        """Advance past a sampled token (a stop token ends the sequence and is not fed to the grammar)."""
        if token == self._eos or bool((self._stop_ids == token).any()):
            return
        if self._after is not None:
            self._before = (self._before + self._tokenizer.decode([token], skip_special_tokens=False))[-256:]
            self._before_ids = (self._before_ids + [token])[-64:]
            if self._before.endswith(self._after):
                self._after = None  # the grammar starts with the next token
            else:
                entered = next((text for text in self._enters_at if self._before.endswith(text)), None)
                if entered is not None:
                    self._after = None
                    for written in self._tokens_of(entered):  # the grammar starts at the text itself
                        self._ll.consume_token(written)
            return
        self._ll.consume_token(token)

    def _free_mask(self) -> torch.Tensor:
        """Before the grammar starts: every token, except one that would write a blocked text."""
        allowed = torch.ones(self._vocab_size, dtype=torch.bool)
        for text, single in self._blocked:
            if single is not None:
                allowed[single] = False
            elif self._before.endswith(text[:-1]):
                last = _single_token(self._tokenizer, text[-1])
                if last is not None:
                    allowed[last] = False
        return allowed

    def _tokens_of(self, text: str) -> list[int]:
        """The ids that wrote `text` at the end of the output (or its encoding, where a token that
        wrote it also wrote something before it)."""
        for k in range(1, len(self._before_ids) + 1):
            written = self._tokenizer.decode(self._before_ids[-k:], skip_special_tokens=False)
            if written == text:
                return self._before_ids[-k:]
            if len(written) > len(text):
                break
        single = _single_token(self._tokenizer, text)
        return [single] if single is not None else self._tokenizer.encode(text)

    @property
    def failed(self) -> str | None:
        """Why the grammar stopped working mid-output (llguidance's error, first line), else None: a grammar
        that compiled can still exceed a limit while matching (a{99999999})."""
        if self._after is not None or not self._ll.is_error():
            return None
        lines = (self._ll.get_error() or "").strip().splitlines()
        return lines[0][:500] if lines else "unknown error"

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return self._after is None and self._ll.is_stopped()


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    """The one token id that writes `text` (a special token, or one character), else None."""
    if text in tokenizer.special_tokens:
        return tokenizer.special_tokens[text]
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text else None
