"""Kimi's tiktoken-style tokenizer: a `tiktoken.model` BPE ranks file + specials from `tokenizer_config.json`.

The ranks file holds one `base64(token bytes) rank` per line. The 256 ids after the ranks are
special tokens: named in `added_tokens_decoder` where the config names them (`[BOS]`, `[EOS]`,
`<|im_end|>`, ...), `<|reserved_token_N|>` otherwise, as in Kimi's `tokenization_kimi.py`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from deltamoe.errors import CheckpointError
from deltamoe.tokenizers.hf import token_name

NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi's pre-tokenizer: Han runs apart, cased word pieces with English contractions, 1-3 digits.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except Exception as e:
            raise CheckpointError(f"{path} line {n}: expected 'base64-token rank', got {line[:60]!r}",
                                  field="tokenizer") from e
    return ranks


class TiktokenKimiTokenizer:
    def __init__(self, model_file: str | Path, tokenizer_config: dict[str, Any] | None = None):
        import tiktoken

        ranks = read_ranks(Path(model_file))
        base = len(ranks)
        cfg = tokenizer_config or {}
        specials = {f"<|reserved_token_{i}|>": base + i for i in range(NUM_RESERVED_SPECIAL_TOKENS)}
        for tid, entry in cfg.get("added_tokens_decoder", {}).items():
            name = token_name(entry)
            if name is not None and int(tid) >= base:
                specials.pop(next((k for k, v in specials.items() if v == int(tid)), ""), None)
                specials[name] = int(tid)
        self._enc = tiktoken.Encoding(name=Path(model_file).stem, pat_str=PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self._specials = specials
        self._special_ids = {v: k for k, v in specials.items()}
        self.vocab_size = base + NUM_RESERVED_SPECIAL_TOKENS
        self.bos_token_id = specials.get(token_name(cfg.get("bos_token", "[BOS]")) or "")
        self.eos_token_id = specials.get(token_name(cfg.get("eos_token", "[EOS]")) or "")
        self.pad_token_id = specials.get(token_name(cfg.get("pad_token")) or "")

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # Special-token text in user input is plain text: specials come only from templates, by name.
        ids = self._enc.encode(text, allowed_special=set(), disallowed_special=())
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(b"" if (skip_special_tokens and i in self._special_ids) else self.token_bytes(i) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return self._special_ids[token_id].encode()
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError as e:
            raise ValueError(f"token id {token_id} is outside this tokenizer's vocabulary ({self.vocab_size})") from e
