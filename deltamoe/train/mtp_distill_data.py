"""Distillation rows for the MTP layer: the model's own greedy continuations, or fresh task answers.

Drafts are verified against what the model writes, so the rows are prompts followed by the
model's greedy continuation (the serving engine decodes them, EOS ignored, so each row also
covers what the model writes after an answer), and only the continuation's positions are scored:
label j counts from j = prompt length + 1 on, the first token a draft is ever made for (the
engine drafts from the last prompt position once the first token is sampled).

Fresh answer rows (`fresh_answer_batches`): a fixed set of continuations is memorised by the MTP
layer (its keys and values are random bytes) instead of teaching it a rule such as "copy the
token after the earlier occurrence". New task examples every step (prompt, true answer, EOS;
scored from the first answer token, the labels still the trunk's argmax) leave no row to
memorise, so only a rule lowers the loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from deltamoe.demo.serve_stage import HeldOutPrompt, answer_prompts
from deltamoe.model.model import IGNORE_INDEX, DeltaMoEForCausalLM
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.data.tasks import Task
from deltamoe.train.mtp_distill import DistillBatch, trunk_targets

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


def padded(rows: list[Continuation], pad_id: int) -> DistillBatch:
    """The rows right-padded with `pad_id` to the longest; `scored` marks each row's continuation
    positions (see the module docstring)."""
    width = max(len(r.token_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, :len(r.token_ids)] = torch.tensor(r.token_ids)
        scored[b, r.prompt_len + 1:len(r.token_ids)] = True
    return DistillBatch(ids, scored)


def shuffled_picks(count: int, batch_size: int, steps: int, seed: int) -> Iterator[list[int]]:
    """`steps` lists of `batch_size` indices into `count` rows, drawn in shuffled passes."""
    if count == 0:
        raise ValueError("no continuation rows to distill on")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            more = list(range(count))
            rng.shuffle(more)
            order += more
        picked, order = order[:batch_size], order[batch_size:]
        yield picked


def continuation_batches(rows: list[Continuation], batch_size: int, steps: int, pad_id: int,
                         seed: int = 0) -> Iterator[DistillBatch]:
    """`steps` batches of `batch_size` rows, right-padded with `pad_id`, drawn in shuffled passes
    over `rows`; `scored` marks each row's continuation positions (see the module docstring)."""
    for picked in shuffled_picks(len(rows), batch_size, steps, seed):
        yield padded([rows[i] for i in picked], pad_id)


@torch.no_grad()
def frozen_trunk_batches(model: DeltaMoEForCausalLM, rows: list[Continuation], batch_size: int, steps: int,
                         seed: int = 0, chunk: int = 64) -> Iterator[DistillBatch]:
    """`continuation_batches`' batches (same rows, same order) carrying the trunk's states and
    labels, computed once per row `chunk` rows at a time: the trunk is frozen during distillation,
    and causal, so a row's states do not depend on the rows or padding beside it."""
    if not rows:
        raise ValueError("no continuation rows to distill on")
    pad_id = model.config.pad_token_id
    whole = padded(rows, pad_id)
    width = whole.input_ids.shape[1]
    hidden, labels = [], []
    for i in range(0, len(rows), chunk):
        part = padded(rows[i:i + chunk], pad_id)
        h, lab = trunk_targets(model, part.input_ids, pad_id, part.scored)
        hidden.append(torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[1])))
        labels.append(torch.nn.functional.pad(lab, (0, width - lab.shape[1]), value=IGNORE_INDEX))
    all_hidden, all_labels = torch.cat(hidden), torch.cat(labels)
    for picked in shuffled_picks(len(rows), batch_size, steps, seed):
        width = max(len(rows[i].token_ids) for i in picked)
        index = torch.tensor(picked)
        yield DistillBatch(whole.input_ids[index, :width], whole.scored[index, :width],
                           all_hidden[index, :width], all_labels[index, :width])


def answer_rows(prompts: list[HeldOutPrompt], encoders: list[Callable[[str], list[int]]],
                answer_ids: Callable[[str], list[int]], eos_id: int) -> list[Continuation]:
    """Each prompt through each encoder, then its true answer's tokens and `eos_id`; scored from the
    first answer token on (`prompt_len` is one short of the prompt, see `padded`)."""
    rows = []
    for p in prompts:
        answer = answer_ids(p.answer) + [eos_id]
        for encode in encoders:
            ids = encode(p.prompt)
            rows.append(Continuation(ids + answer, len(ids) - 1))
    return rows


def fresh_answer_batches(tasks: dict[str, tuple[Task, int]], encoders: list[Callable[[str], list[int]]],
                         answer_ids: Callable[[str], list[int]], eos_id: int, pad_id: int, steps: int,
                         seed: int = 0, split: str = "train") -> Iterator[DistillBatch]:
    """`steps` batches of new examples: for each task name, (task, examples per step) drawn from
    `split` with a seed of their own per step (`answer_prompts`), each as `answer_rows` (one row per
    encoder), right-padded with `pad_id`."""
    if not tasks or any(n < 1 for _, n in tasks.values()):
        raise ValueError("fresh answer rows need at least one task with >= 1 example per step")
    for step in range(steps):
        prompts = [p for task, n in tasks.values() for p in answer_prompts(task, n, seed * 1_000_003 + step, split)]
        yield padded(answer_rows(prompts, encoders, answer_ids, eos_id), pad_id)
