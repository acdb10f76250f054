"""Prompt logprobs: log p(prompt token j | tokens < j) for j >= 1, computed during prefill.

A prefill chunk of n tokens starting at position a yields the model's prediction at each of its
positions; the one at position p scores prompt token p + 1. The runner keeps the chunk's hidden
states for a sequence that asks (`SamplingParams.prompt_logprobs`) and projects them here (the
engine otherwise projects only each row's last position). Entries are recorded once per token:
a preempted sequence recomputes its prompt without appending them again. Prefix-cache hits are
off for such a sequence (`HybridCache._match_prefix`): a hit would skip the very tokens whose
logprobs it asked for.
"""

from __future__ import annotations

import torch

from deltamoe.serve.engine.sampling import TokenLogprob
from deltamoe.serve.engine.sequence import Sequence


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Asked for, and some prompt token (after the first) not scored yet."""
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1


def scored_span(seq: Sequence, n: int) -> tuple[int, int] | None:
    """(first, last): the prompt tokens a chunk of `n` tokens from `seq.num_computed` scores; None: none."""
    first = max(seq.num_computed + 1, len(seq.prompt_logprobs) + 1)  # the first prompt token to score
    last = min(seq.num_computed + n, seq.num_prompt_tokens - 1)  # the last one this chunk can score
    return (first, last) if first <= last else None


def projected_rows(seq: Sequence, n: int) -> tuple[int, int]:
    """The chunk's hidden-state rows [lo, hi) whose predictions score `scored_span` (call it first)."""
    first, last = scored_span(seq, n)
    return first - 1 - seq.num_computed, last - seq.num_computed


def chunk_prompt_logprobs(model, seq: Sequence, n: int, hidden: torch.Tensor | None,
                          last_logits: torch.Tensor) -> list[TokenLogprob]:
    """The prompt tokens scored by this chunk of `n` tokens from `seq.num_computed` (before the step).
    `hidden`: the chunk's hidden states [n, D] (None for a one-token chunk: `last_logits` [V] is its only prediction)."""
    span = scored_span(seq, n)
    if span is None:
        return []
    first, last = span
    if hidden is None:
        logits = last_logits[None].float()
    else:
        lo, hi = projected_rows(seq, n)
        logits = model.lm_head(model.model.norm(hidden[lo:hi])).float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(seq.token_ids[first:last + 1], device=logp.device)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    top_n = seq.params.prompt_logprobs
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if top_n:
        values, ids = torch.topk(logp, top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(seq.token_ids[first:last + 1], chosen, tops)]


def call_projections(group: list[tuple[Sequence, int]]) -> list[tuple[int, int, int]]:
    """The LM-head projections `ModelRunner.run` makes for one call's prompt logprobs, in its order, as
    (row, lo, hi) hidden-state rows. The other ranks of a --tp replica make the same ones with rank 0:
    the vocabulary-parallel LM head is a collective (its all-gather)."""
    if max(n for _, n in group) <= 1:  # one-token chunks score from the call's logits: no projection
        return []
    return [(row, *projected_rows(seq, n)) for row, (seq, n) in enumerate(group)
            if wants_prompt_logprobs(seq) and scored_span(seq, n) is not None]
