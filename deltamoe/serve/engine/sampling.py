"""The sampler (what a request asks: `sampling_params.SamplingParams`, re-exported here): logit bias -> penalties -> temperature -> top-k/top-p/min-p -> draw.

Greedy when temperature < GREEDY_TEMPERATURE (0 included). Each request draws from its own
`torch.Generator`, so the same seed gives the same tokens whatever else is in the batch. Logprobs are those of the model's
raw distribution (log_softmax of the logits before penalties and temperature), as vLLM does.
"""

from __future__ import annotations

import torch

# What a request asks (re-exported: callers import them from here too).
from deltamoe.serve.engine.sampling_params import (GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS,  # noqa: F401
                                                    SamplingParams, TokenLogprob)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit plus its bias (100 all but forces it, -100 all but bans it)."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), device=logits.device)
    return logits.index_add(-1, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def apply_penalties(logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI penalties over the tokens generated so far: l -= frequency * count + presence * [count > 0]."""
    if not output_ids or (presence == 0 and frequency == 0):
        return logits
    counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1])
    counts = counts[: logits.shape[-1]].to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every token outside top-k, outside the top-p nucleus, or below min_p * p_max. [..., V]."""
    out = logits.float().clone()
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is below top_p: the smallest set reaching top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        out = out.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return out


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logp, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logp[token_id]), top)


def draw_token(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
               generator: torch.Generator, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One next token for one request from its last-position logits [V], as a 0-d tensor on their
    device; only `allowed` ones (a grammar's bool [V] mask), when given."""
    x = apply_logit_bias(logits.float(), params.logit_bias)
    if allowed is not None:
        x = x.masked_fill(~allowed.to(x.device), float("-inf"))
    x = apply_penalties(x, output_ids, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return torch.argmax(x)
    x = filter_logits(x / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_row(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
               generator: torch.Generator, allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprob | None]:
    """One next token for one request from its last-position logits [V]; only `allowed` ones, when given."""
    token = int(draw_token(logits, params, output_ids, generator, allowed))
    lp = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
    return token, lp


def _plain(params: list[SamplingParams], allowed: list[torch.Tensor | None]) -> list[bool]:
    """Rows whose token is the argmax of the raw logits (one batched argmax serves them all)."""
    return [p.greedy and p.logprobs is None and p.presence_penalty == 0 and p.frequency_penalty == 0
            and not p.logit_bias and a is None for p, a in zip(params, allowed)]


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
           generators: list[torch.Generator],
           allowed: list[torch.Tensor | None] | None = None) -> list[tuple[int, TokenLogprob | None]]:
    """Next tokens for a batch of last-position logits [B, V]; plain greedy rows take one batched argmax.
    `allowed`: per row, the bool [V] mask of a grammar-constrained request (None: unconstrained)."""
    allowed = allowed or [None] * len(params)
    plain = _plain(params, allowed)
    fast = torch.argmax(logits, dim=-1).tolist() if any(plain) else []
    if all(plain):
        return [(token, None) for token in fast]
    return [(fast[i], None) if plain[i] else sample_row(logits[i], params[i], outputs[i], generators[i], allowed[i])
            for i in range(len(params))]


def draw_tokens(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
                generators: list[torch.Generator]) -> torch.Tensor:
    """`sample`'s tokens as a tensor [B] on the logits' device, read by no host: the one-step-ahead
    driver feeds them to the next step's inputs before any host has seen them (logprobs aside)."""
    plain = _plain(params, [None] * len(params))
    if all(plain):
        return torch.argmax(logits, dim=-1)
    fast = torch.argmax(logits, dim=-1) if any(plain) else None
    return torch.stack([fast[i] if plain[i] else draw_token(logits[i], params[i], outputs[i], generators[i])
                        for i in range(len(params))])
