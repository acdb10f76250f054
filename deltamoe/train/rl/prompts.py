"""Verifiable prompts from the built-in tasks: the text before an example's first answer, and that answer.

A prompt is tokenised exactly as `TaskStream` lays out a row's first example (BOS, then the example's
bytes), so a model supervised on the task sees a familiar start and should answer, then emit EOS.
Train and held-out prompts come from the task's disjoint splits (`draw_example`); prompt i of a split
is a pure function of (seed, split, i), so a resumed run draws the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deltamoe.train.data.task_stream import draw_example
from deltamoe.train.data.tasks import VALUES, Task, make_task
from deltamoe.train.rl.config import RLConfig


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]  # BOS + the text's bytes
    answer: str


class TaskPrompts:
    def __init__(self, cfg: RLConfig, bos: int):
        self.task: Task = make_task(cfg.task, digits=cfg.digits, num_pairs=cfg.num_pairs, num_queries=1)
        self.seed, self.bos = cfg.seed, bos
        # The characters an answer is written in: what the format reward checks.
        self.alphabet = frozenset("0123456789" if cfg.task == "arithmetic" else VALUES)

    @property
    def max_answer_len(self) -> int:
        return self.task.digits + 1 if hasattr(self.task, "digits") else 1

    def prompt(self, split: str, index: int) -> Prompt:
        segments = draw_example(self.task, random.Random(f"rl/{self.seed}/{split}/{index}"), split)
        first = next(i for i, (_, is_answer) in enumerate(segments) if is_answer)
        text = "".join(t for t, _ in segments[:first])
        return Prompt(text, [self.bos, *text.encode()], segments[first][0])

    def batch(self, split: str, start: int, count: int) -> list[Prompt]:
        return [self.prompt(split, i) for i in range(start, start + count)]
