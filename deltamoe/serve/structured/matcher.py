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
        # Before `constraint.after` (the end of the reasoning) the output is free; its text so far.
        self._after, self._tokenizer, self._before = constraint.after, tokenizer, ""

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar accepts next (ids past the tokenizer's never)."""
        if self._after is not None:
            return torch.ones(self._vocab_size, dtype=torch.bool)
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
            if self._before.endswith(self._after):
                self._after = None  # the grammar starts with the next token
            return
        self._ll.consume_token(token)

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

