"""The tokenizer for text data: a checkpoint's `tokenizer.json` when it has one, else bytes."""

from __future__ import annotations

from pathlib import Path

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.tokenizers.byte import ByteTokenizer


class HFTokenizerFile:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json, seen through the encode side of our protocol."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids


def data_tokenizer(model_path: str | None, config: ModelConfig) -> HFTokenizerFile | ByteTokenizer:
    if model_path is not None and (Path(model_path) / "tokenizer.json").is_file():
        tok = HFTokenizerFile(Path(model_path) / "tokenizer.json")
        if tok.vocab_size > config.vocab_size:
            raise ConfigError(f"tokenizer.json has {tok.vocab_size} tokens, the model only {config.vocab_size}",
                              field="model.path")
        return tok
    if config.vocab_size < 259:
        raise ConfigError(f"byte-level data needs vocab_size >= 259, the model has {config.vocab_size}",
                          field="model", hint="use a checkpoint with a tokenizer.json")
    return ByteTokenizer(config.vocab_size)
