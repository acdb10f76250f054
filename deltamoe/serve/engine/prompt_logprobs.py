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

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PromptScoring:
    """Host data to score one row's chunk (taken before the step, so a device thread can score it later)."""

    row: int  # the row of its call
    first: int  # the first prompt position scored
    targets: list[int]  # the prompt tokens scored, from `first` on
    top_n: int
    hidden_rows: tuple[int, int] | None  # the chunk's hidden rows [lo, hi) to project; None: the call's logits


def plan_scoring(row: int, seq: Sequence, n: int, multi_token_call: bool) -> PromptScoring | None:
    """What `score_chunk` needs for `seq`'s chunk of `n` tokens from `seq.num_computed` (before the step);
    None when the chunk scores nothing. `multi_token_call`: the call has a chunk longer than one token
    (a one-token call keeps no hidden states: its logits are the only prediction)."""
    span = scored_span(seq, n)
    if span is None:
        return None
    first, last = span
    return PromptScoring(row, first, seq.token_ids[first:last + 1], seq.params.prompt_logprobs or 0,
                         projected_rows(seq, n) if multi_token_call else None)


def score_chunk(model, scoring: PromptScoring, hidden: torch.Tensor | None, last_logits: torch.Tensor
                ) -> list[TokenLogprob]:
    """The planned prompt tokens' logprobs. `hidden`: the row's hidden states (when `hidden_rows`);
    `last_logits` [V]: the row's last-position logits."""
    if scoring.hidden_rows is None:
        logits = last_logits[None].float()
    else:
        lo, hi = scoring.hidden_rows
        logits = model.lm_head(model.model.norm(hidden[lo:hi])).float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(scoring.targets, device=logp.device)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if scoring.top_n:
        values, ids = torch.topk(logp, scoring.top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(scoring.targets, chosen, tops)]


def chunk_prompt_logprobs(model, seq: Sequence, n: int, hidden: torch.Tensor | None,
                          last_logits: torch.Tensor) -> list[TokenLogprob]:
    """The prompt tokens scored by this chunk of `n` tokens from `seq.num_computed` (before the step).
    `hidden`: the chunk's hidden states [n, D] (None for a one-token chunk: `last_logits` [V] is its only prediction)."""
    scoring = plan_scoring(0, seq, n, hidden is not None)
    return [] if scoring is None else score_chunk(model, scoring, hidden, last_logits)


def call_scorings(group: list[tuple[Sequence, int]]) -> list[PromptScoring]:
    """Every row of one call that scores prompt tokens this step, in row order (before the step)."""
    multi = max(n for _, n in group) > 1
    return [scoring for row, (seq, n) in enumerate(group) if wants_prompt_logprobs(seq)
            if (scoring := plan_scoring(row, seq, n, multi)) is not None]


def call_projections(group: list[tuple[Sequence, int]]) -> list[tuple[int, int, int]]:
    """The LM-head projections `ModelRunner.run` makes for one call's prompt logprobs, in its order, as
    (row, lo, hi) hidden-state rows. The other ranks of a --tp replica make the same ones with rank 0:
    the vocabulary-parallel LM head is a collective (its all-gather)."""
    return [(sc.row, *sc.hidden_rows) for sc in call_scorings(group) if sc.hidden_rows is not None]
