"""The tokenizer interface shared by training data, the engine and the server."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (specials: their text), for incremental UTF-8-safe detokenization."""
        ...

    @property
    def special_tokens(self) -> dict[str, int]: ...
