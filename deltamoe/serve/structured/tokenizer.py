"""A deltamoe Tokenizer as llguidance sees it: every id's raw bytes, the specials by name, EOS."""

from __future__ import annotations

import threading
import weakref

import llguidance

from deltamoe.errors import RequestError
from deltamoe.tokenizers.base import Tokenizer

_cache: "weakref.WeakKeyDictionary[object, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Vocabulary:
    """The attributes `llguidance.TokenizerWrapper` reads, built once from `token_bytes`."""

    def __init__(self, tokenizer: Tokenizer):
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_tokens.values())
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer object (it walks the whole vocabulary)."""
    with _lock:
        found = _cache.get(tokenizer)
        if found is None:
            if tokenizer.eos_token_id is None:
                raise RequestError("structured outputs need a tokenizer with an end-of-sequence token; this "
                                   "one has none (name it as eos_token in tokenizer_config.json)",
                                   field="response_format")
            found = _cache[tokenizer] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)))
        return found
