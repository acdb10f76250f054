"""Tokenizers: byte-level default; HF tokenizer.json and tiktoken-style Kimi files arrive beside it."""

from deltamoe.tokenizers.base import Tokenizer
from deltamoe.tokenizers.byte import ByteTokenizer

__all__ = ["Tokenizer", "ByteTokenizer"]
