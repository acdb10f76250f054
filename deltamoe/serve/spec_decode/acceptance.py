"""Which draft tokens to keep: the target's greedy choice, or rejection sampling.

Rejection sampling (Leviathan et al., Chen et al.): draft d_j drawn from q_j is kept with
probability min(1, p_j(d_j) / q_j(d_j)); the first rejected position draws from the residual
norm(max(0, p_j - q_j)) instead, and when every draft is kept a bonus token comes from p_K. Every
emitted token is then distributed exactly as the target's p given the tokens before it, whatever q.
"""

from __future__ import annotations

import torch

from deltamoe.serve.engine.sampling import SamplingParams, apply_penalties, filter_logits


def target_probs(logits: torch.Tensor, params: SamplingParams, output_ids: list[int], drafts: list[int]
                 ) -> torch.Tensor:
    """[K+1, V] logits -> the sampler's distribution at each position, position j counting the
    first j drafts among the generated tokens (penalties) as the sampler would had it emitted them."""
    rows = []
    for j in range(logits.shape[0]):
        x = apply_penalties(logits[j].float(), output_ids + drafts[:j], params.presence_penalty,
                            params.frequency_penalty)
        rows.append(torch.softmax(filter_logits(x / params.temperature, params.top_k, params.top_p, params.min_p), -1))
    return torch.stack(rows)


def draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampling request's draft is drawn from: the MTP logits [.., V] through the
    request's temperature and filters (no penalties: rejection sampling corrects any q)."""
    return torch.softmax(filter_logits(logits.float() / params.temperature, params.top_k, params.top_p,
                                       params.min_p), -1)


def greedy_targets(logits: torch.Tensor, params: SamplingParams, output_ids: list[int], drafts: list[int]
                   ) -> list[int]:
    """The greedy sampler's token at each of the K+1 positions (penalties as in `target_probs`)."""
    if params.presence_penalty == 0 and params.frequency_penalty == 0:
        return torch.argmax(logits, dim=-1).tolist()
    return [int(torch.argmax(apply_penalties(logits[j].float(), output_ids + drafts[:j], params.presence_penalty,
                                             params.frequency_penalty))) for j in range(logits.shape[0])]


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Drafts up to the first that differs from the target's choice, then the target's token there."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]]


def rejection_sample(target: torch.Tensor, draft: torch.Tensor, drafts: list[int],
                     generator: torch.Generator) -> list[int]:
    """target [K+1, V] and draft [K, V] probabilities; `drafts` drawn from `draft` -> emitted tokens
    (the kept drafts, then one token from the residual or the bonus position)."""
    for j, d in enumerate(drafts):
        p, q = target[j], draft[j]
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        # p == q up to rounding leaves no residual mass; p itself is then the residual's limit.
        pick = torch.multinomial(residual / total if total > 0 else p, 1, generator=generator)
        return drafts[:j] + [int(pick)]
    return drafts + [int(torch.multinomial(target[-1], 1, generator=generator))]
