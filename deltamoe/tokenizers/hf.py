"""A checkpoint's HF `tokenizer.json`, through the `tokenizers` library, behind the Tokenizer protocol."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from deltamoe.errors import CheckpointError

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> raw byte."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(visible)
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars)}


def token_name(value: Any) -> str | None:
    """`tokenizer_config.json` writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    def __init__(self, path: str | Path, tokenizer_config: dict[str, Any] | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path)
        try:
            self._tok = RustTokenizer.from_file(str(path))
            spec = json.loads(path.read_text())
        except Exception as e:  # the library raises plain Exceptions with a parser message
            raise CheckpointError(f"cannot read {path}: {e}", field="tokenizer") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._byte_level = "ByteLevel" in json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
        cfg = tokenizer_config or {}
        self.bos_token_id = self._id_of(cfg.get("bos_token"))
        self.eos_token_id = self._id_of(cfg.get("eos_token"))
        self.pad_token_id = self._id_of(cfg.get("pad_token"))

    def _id_of(self, value: Any) -> int | None:
        name = token_name(value)
        return None if name is None else self._tok.token_to_id(name)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside this tokenizer's vocabulary ({self.vocab_size})")
        if piece in self._specials:
            return piece.encode()
        if self._byte_level:
            table = byte_decoder()
            return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        # SentencePiece-style: byte-fallback pieces and the '▁' word boundary.
        m = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()
