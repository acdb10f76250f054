"""Plain-text and jsonl corpora: tokenized once, documents joined by EOS, packed into rows.

The whole token stream is cut into consecutive rows of `seq_len` tokens (a document may
continue into the next row; the tail shorter than one row is dropped). The last
`eval_fraction` of the rows is held out. Training visits the remaining rows in a fresh
seeded permutation each epoch, so row i is still a pure function of (seed, i).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deltamoe.errors import ConfigError
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.train.data.rows import SPLITS, Rows


def read_documents(path: str | Path) -> list[str]:
    """A .jsonl file gives one document per line (`{"text": ...}`); any other file is one document.
    Both must be UTF-8 (a leading BOM is dropped): bytes that are not would train on U+FFFD."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; expected a .txt or .jsonl file", field="data.path")
    if not path.is_file():
        raise ConfigError(f"data file {path} does not exist", field="data.path")
    text = decode_utf8(path)
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is valid inside JSON
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n} is not valid JSON ({e.msg}: column {e.colno})",
                              field="data.path") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ConfigError(f'{path}:{n} has no string "text" field', field="data.path")
        docs.append(obj["text"])
    return docs


def decode_utf8(path: Path) -> str:
    """The file's text; ConfigError naming the line and byte offset of the first byte that is not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}", field="data.path") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line} is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})",
                          field="data.path", hint="convert the file to UTF-8, e.g. with iconv") from None


def pack_documents(docs: list[list[int]], seq_len: int, eos: int) -> torch.Tensor:
    """[rows, seq_len]: the documents back to back, each followed by EOS, cut into rows."""
    stream = [t for doc in docs for t in (*doc, eos)]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class TextSource:
    scores_answers = False

    def __init__(self, path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int, eval_fraction: float,
                 eval_rows: int, eos: int):
        self.name, self.seq_len, self.seed = Path(path).name, seq_len, seed
        packed = pack_documents([tokenizer.encode(d) for d in read_documents(path)], seq_len, eos)
        if len(packed) < 1:
            raise ConfigError(f"{path} holds fewer than seq_len ({seq_len}) tokens", field="data.path")
        held = min(round(len(packed) * eval_fraction), len(packed) - 1)
        if eval_fraction > 0 and len(packed) >= 2:
            held = max(held, 1)
        self.train, self.eval = packed[: len(packed) - held], packed[len(packed) - held:]
        self.eval_rows = min(eval_rows, len(self.eval))
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.train), generator=g))
        return self._perm[1]

    def rows(self, split: str, start: int, count: int) -> Rows:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "eval":
            ids = self.eval[torch.arange(start, start + count) % max(len(self.eval), 1)]
        else:
            n = len(self.train)
            ids = torch.stack([self.train[self._order(i // n)[i % n]] for i in range(start, start + count)])
        return Rows(ids.clone(), ids.clone())
