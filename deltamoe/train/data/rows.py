"""Rows: what a data source hands the trainer. Input ids and labels [rows, seq_len], where
labels equal the ids on scored tokens and IGNORE_INDEX elsewhere (the model shifts them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deltamoe.model.model import IGNORE_INDEX

SPLITS = ("train", "eval")


@dataclass
class Rows:
    input_ids: torch.Tensor  # [n, T] int64
    labels: torch.Tensor  # [n, T] int64, IGNORE_INDEX where unscored

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class DataSource(Protocol):
    """Random access by row index: row i of a split is a pure function of (config, seed, i),
    so the data position is one integer and any data rank can read any slice."""

    name: str
    seq_len: int
    eval_rows: int  # rows in the held-out split that one evaluation scores
    scores_answers: bool  # True: evaluation reports answer accuracy (tasks), else loss only

    def rows(self, split: str, start: int, count: int) -> Rows: ...


def stack_rows(rows: list[tuple[list[int], list[int]]]) -> Rows:
    ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
    labels = torch.tensor([r[1] for r in rows], dtype=torch.long)
    return Rows(ids, labels)


def masked_labels(tokens: list[int], scored: list[bool]) -> list[int]:
    return [t if s else IGNORE_INDEX for t, s in zip(tokens, scored)]
