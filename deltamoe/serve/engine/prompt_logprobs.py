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


def chunk_prompt_logprobs(model, seq: Sequence, n: int, hidden: torch.Tensor | None,
                          last_logits: torch.Tensor) -> list[TokenLogprob]:
    """The prompt tokens scored by this chunk of `n` tokens from `seq.num_computed` (before the step).
    `hidden`: the chunk's hidden states [n, D] (None for a one-token chunk: `last_logits` [V] is its only prediction)."""
    start = seq.num_computed
    first = max(start + 1, len(seq.prompt_logprobs) + 1)  # the first prompt token to score
    last = min(start + n, seq.num_prompt_tokens - 1)  # the last one this chunk can score
    if first > last:
        return []
    if hidden is None:
        logits = last_logits[None].float()
    else:
        rows = hidden[first - 1 - start: last - start]
        logits = model.lm_head(model.model.norm(rows)).float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(seq.token_ids[first:last + 1], device=logp.device)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    top_n = seq.params.prompt_logprobs
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if top_n:
        values, ids = torch.topk(logp, top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(seq.token_ids[first:last + 1], chosen, tops)]
