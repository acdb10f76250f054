"""`load_tokenizer(path_or_none, vocab_size)`: the one place that picks a tokenizer for a model.

- None, or a checkpoint folder without tokenizer files: the byte tokenizer.
- a folder (or file) with `tokenizer.json`: the HF tokenizer (`tokenizers` library).
- a folder with `tiktoken.model` (or a `*.tiktoken` / `tiktoken.model` file): Kimi's tiktoken tokenizer.
`tokenizer_config.json` beside them supplies bos/eos/pad names, added specials and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltamoe.errors import ConfigError
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.tokenizers.byte import ByteTokenizer

TIKTOKEN_FILES = ("tiktoken.model", "tokenizer.model")


def tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})", field="tokenizer") from e


def load_tokenizer(path: str | Path | None, vocab_size: int) -> Tokenizer:
    tok = _pick(Path(path) if path is not None else None, vocab_size)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model only {vocab_size}",
                          field="tokenizer", hint="pass the tokenizer that belongs to this checkpoint")
    return tok


def _pick(path: Path | None, vocab_size: int) -> Tokenizer:
    if path is not None and path.is_file():
        folder, files = path.parent, [path]
    elif path is not None and path.is_dir():
        folder, files = path, [path / "tokenizer.json", *(path / n for n in TIKTOKEN_FILES)]
    elif path is None:
        folder, files = None, []
    else:
        raise ConfigError(f"no tokenizer at {path}", field="tokenizer", hint="a folder or a tokenizer file")
    for f in files:
        if not f.exists():
            continue
        cfg = tokenizer_config(folder)
        if f.name.endswith(".json"):
            from deltamoe.tokenizers.hf import HFTokenizer

            return HFTokenizer(f, cfg)
        from deltamoe.tokenizers.tiktoken_kimi import TiktokenKimiTokenizer

        return TiktokenKimiTokenizer(f, cfg)
    if vocab_size < 259:
        raise ConfigError(f"the byte tokenizer needs a vocabulary of at least 259 ids, the model has {vocab_size}",
                          field="tokenizer", hint="pass --tokenizer with the checkpoint's tokenizer files")
    return ByteTokenizer(min(vocab_size, 264))
