"""Byte-level tokenizer: ids 0..255 are bytes, then a few named specials (the `tiny` preset's 264-token vocab)."""

from __future__ import annotations

# The ninth, the image placeholder, exists only in a vocabulary with room for it (`tiny-vision`: 265).
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|sep|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
            "<|image|>")
TEXT_SPECIALS = 8  # the `tiny` preset's 264-token vocabulary holds the first eight


class ByteTokenizer:
    """UTF-8 bytes as tokens. Lossless for any text; specials are only produced by name, never by encode."""

    def __init__(self, vocab_size: int = 256 + TEXT_SPECIALS):
        if vocab_size < 256 + 3:
            raise ValueError(f"vocab_size: a byte tokenizer needs at least 259 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        names = SPECIALS[: vocab_size - 256]
        self._specials = {name: 256 + i for i, name in enumerate(names)}
        self._special_names = {i: n for n, i in self._specials.items()}
        self.bos_token_id = self._specials["<|bos|>"]
        self.eos_token_id = self._specials["<|eos|>"]
        self.pad_token_id = self._specials["<|pad|>"]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        name = self._special_names.get(token_id)
        if name is None:
            raise ValueError(f"token id {token_id} is outside this tokenizer's vocabulary ({self.vocab_size})")
        return name.encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= 256 and skip_special_tokens:
                continue
            out += self.token_bytes(i)
        return out.decode("utf-8", errors="replace")
