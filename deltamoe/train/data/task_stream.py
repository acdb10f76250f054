"""A synthetic task as a row stream: examples packed into fixed-length rows, generated on the fly.

Row i of a split uses its own generator seeded by (seed, split, i): deterministic, O(1) to
reach any position (resume, data ranks), and independent of the batch size.
"""

from __future__ import annotations

import random

from deltamoe.errors import ConfigError
from deltamoe.train.data.rows import SPLITS, Rows, masked_labels, stack_rows
from deltamoe.train.data.tasks import Segment, Task, in_eval_split

MAX_TRIES = 10_000  # rejection sampling for the split; the eval bucket is 1/16 of examples


class TaskStream:
    """Each row: BOS, then whole examples each followed by EOS while they fit, then PAD.
    Only the answer bytes are scored."""

    scores_answers = True

    def __init__(self, task: Task, seq_len: int, seed: int, eval_rows: int, *, bos: int, eos: int, pad: int):
        self.task, self.seq_len, self.seed, self.eval_rows = task, seq_len, seed, eval_rows
        self.bos, self.eos, self.pad = bos, eos, pad
        self.name = task.name
        if task.max_len + 2 > seq_len:  # BOS + example + EOS must fit in one row
            raise ConfigError(f"task {task.name!r} needs rows of at least {task.max_len + 2} tokens, got {seq_len}",
                              field="data.seq_len")

    def _example(self, rng: random.Random, split: str) -> list[Segment]:
        return draw_example(self.task, rng, split)

    @staticmethod
    def _tokens(segments: list[Segment]) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        scored: list[bool] = []
        for text, is_answer in segments:
            b = list(text.encode())
            tokens += b
            scored += [is_answer] * len(b)
        return tokens, scored

    def row(self, split: str, index: int) -> tuple[list[int], list[int]]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"{self.seed}/{split}/{index}")
        tokens, scored = [self.bos], [False]
        while True:
            ex_tokens, ex_scored = self._tokens(self._example(rng, split))
            if len(tokens) + len(ex_tokens) + 1 > self.seq_len:
                break
            tokens += ex_tokens + [self.eos]
            scored += ex_scored + [False]
        pad = self.seq_len - len(tokens)
        tokens += [self.pad] * pad
        scored += [False] * pad
        return tokens, masked_labels(tokens, scored)

    def rows(self, split: str, start: int, count: int) -> Rows:
        return stack_rows([self.row(split, i) for i in range(start, start + count)])


def draw_example(task: Task, rng: random.Random, split: str) -> list[Segment]:
    """The next example of `split` from `rng`: examples of the other split are rejected."""
    want_eval = split == "eval"
    for _ in range(MAX_TRIES):
        segments = task.example(rng)
        if in_eval_split(segments) == want_eval:
            return segments
    raise ConfigError(f"task {task.name!r} has too few distinct examples for a held-out split",
                      field="data.task", hint="use more digits, pairs or a longer string length")
