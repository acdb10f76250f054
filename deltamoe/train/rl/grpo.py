"""GRPO's math: group-normalised advantages and the clipped token-level policy-gradient loss.

For prompt q with G completions o_1..o_G and rewards r_1..r_G:
    A_i = (r_i - mean(r)) / (std(r) + eps)                    (one advantage for every token of o_i)
    ratio_{i,t} = exp(logp(o_{i,t}) - logp_old(o_{i,t}))        (logp_old: the policy that sampled)
    L = - sum_{i,t} min(ratio * A_i, clip(ratio, 1 - e, 1 + e) * A_i) / (number of tokens)
      + beta * sum_{i,t} KL_{i,t} / (number of tokens)
with KL the k3 estimator exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased) against a frozen
reference policy. The loss is averaged over all tokens of the batch ("token-level", as DAPO and
trl's default do), so long completions are not down-weighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, norm: str = "std") -> torch.Tensor:
    """rewards [groups, G] -> advantages [groups, G]; a group with equal rewards gets zeros (no signal).

    norm "std" (GRPO): (r - mean) / std. norm "mean": (r - mean) / mean, the policy gradient of the
    log of each prompt's expected reward (for 0/1 rewards: of log pass rate), which weighs every
    prompt alike instead of favouring the half-solved ones; rewards must be >= 0."""
    mean = rewards.mean(dim=1, keepdim=True)
    scale = rewards.std(dim=1, keepdim=True, unbiased=False) if norm == "std" else mean
    return (rewards - mean) / (scale + ADV_EPS)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] (position t predicts token t+1), tokens [B, T] -> logp of tokens[:, 1:] [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@dataclass
class LossParts:
    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float  # share of completion tokens whose ratio was clipped where it mattered


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
              tokens: torch.Tensor | None = None) -> LossParts:
    """All [B, T-1] except advantages [B]; mask 1 on completion tokens. Or all [N], one entry per
    scored token, with `mask` the number of completions each stands for (`batch.py`). `tokens`: the
    normaliser when these rows are one data rank's share of a batch (the whole batch's completion
    tokens); default: this mask's sum."""
    mask = mask.float()
    n = mask.sum().clamp(min=1.0) if tokens is None else tokens
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None] if advantages.dim() < logp.dim() else advantages
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    policy = (per_token * mask).sum() / n
    loss = policy
    kl_value = 0.0
    if ref_logp is not None:
        d = ref_logp - logp
        kl = (torch.exp(d) - d - 1.0) * mask
        kl_value = float(kl.detach().sum() / n)
        if kl_coef > 0:
            loss = loss + kl_coef * kl.sum() / n
    clip_fraction = float(((clipped < unclipped).float() * mask).sum() / n)
    return LossParts(loss, float(policy.detach()), kl_value, clip_fraction)
