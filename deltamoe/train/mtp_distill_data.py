"""Distillation rows for the MTP layer from the model's own greedy continuations.

Drafts are verified against what the model writes, so the rows are prompts followed by the
model's greedy continuation (the serving engine decodes them, EOS ignored, so each row also
covers what the model writes after an answer), and only the continuation's positions are scored:
label j counts from j = prompt length + 1 on, the first token a draft is ever made for (the
engine drafts from the last prompt position once the first token is sampled).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

import torch

from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.mtp_distill import DistillBatch

MIN_NEW_TOKENS = 8  # every depth up to 3 needs scored labels in every row


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]  # the prompt, then the model's greedy tokens
    prompt_len: int


def own_continuations(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[Continuation]:
    """Each prompt with the engine's greedy continuation of `new_tokens` tokens (EOS ignored)."""
    if new_tokens < MIN_NEW_TOKENS:
        raise ValueError(f"new_tokens must be >= {MIN_NEW_TOKENS}, got {new_tokens}")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    completions = engine.generate(prompts, params, progress=False)
    return [Continuation(p + c.token_ids, len(p)) for p, c in zip(prompts, completions)]


def continuation_batches(rows: list[Continuation], batch_size: int, steps: int, pad_id: int,
                         seed: int = 0) -> Iterator[DistillBatch]:
    """`steps` batches of `batch_size` rows, right-padded with `pad_id`, drawn in shuffled passes
    over `rows`; `scored` marks each row's continuation positions (see the module docstring)."""
    if not rows:
        raise ValueError("no continuation rows to distill on")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            more = list(range(len(rows)))
            rng.shuffle(more)
            order += more
        picked, order = [rows[i] for i in order[:batch_size]], order[batch_size:]
        width = max(len(r.token_ids) for r in picked)
        ids = torch.full((len(picked), width), pad_id, dtype=torch.long)
        scored = torch.zeros(len(picked), width, dtype=torch.bool)
        for b, r in enumerate(picked):
            ids[b, :len(r.token_ids)] = torch.tensor(r.token_ids)
            scored[b, r.prompt_len + 1:len(r.token_ids)] = True
        yield DistillBatch(ids, scored)
