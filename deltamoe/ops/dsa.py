"""DeepSeek Sparse Attention (DSA): lightning-indexer scores and the causal top-k.

The indexer scores every visible key cheaply; each query then runs MLA over only its
top-k keys (`mla.mla_attention(..., selected=topk_mask(...))` for prefill, or
`mla.mla_attention_absorbed_rows` over the cached rows at those slots for decode). Visibility
(causality and per-row lengths) is `mla.visible_keys`, so the indexer and the attention agree on it.

Constant positive factors (DeepSeek's n_heads^-1/2 * head_dim^-1/2 on the weights, the
softmax scale on q.k) do not change the ranking, so `indexer_scores` leaves them to the
caller; the Hadamard rotation and FP8/FP4 quantization of the reference kernels are
precision/speed devices and are not modelled here.
"""

from __future__ import annotations

import torch

from deltamoe.ops.mla import visible_counts, visible_keys
from deltamoe.ops.shapes import check_shape


def indexer_scores(q_index: torch.Tensor, k_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """score[b,t,s] = sum_h weights[b,t,h] * relu(q_index[b,t,h] . k_index[b,s]) -> fp32 [B, T, S].

    q_index [B,T,Hi,Di]; k_index [B,S,Di] (one key shared by all index heads); weights [B,T,Hi].
    Scores are computed for every slot; masking invisible slots is `causal_topk`'s job.
    """
    if q_index.dim() != 4:
        raise ValueError(f"q_index: expected shape [B, T, Hi, Di], got {tuple(q_index.shape)}")
    batch, time, heads, dim = q_index.shape
    check_shape("k_index", k_index, "[B, S, Di]", (batch, None, dim))
    check_shape("weights", weights, "[B, T, Hi]", (batch, time, heads))
    # Two batched matmuls with no broadcast (a broadcast matmul over T would first copy the keys):
    # [B,T*Hi,Di] @ [B,Di,S] -> per-head logits [B,T*Hi,S]; then [B*T,1,Hi] @ [B*T,Hi,S].
    queries = q_index.float().reshape(batch, time * heads, dim)
    logits = torch.relu_(torch.bmm(queries, k_index.float().transpose(1, 2)))
    scores = torch.bmm(weights.float().reshape(batch * time, 1, heads), logits.view(batch * time, heads, -1))
    return scores.view(batch, time, -1)


def indexer_scores_reference(q_index: torch.Tensor, k_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Readable form of `indexer_scores`: the formula with one einsum per step."""
    logits = torch.einsum("bthd,bsd->bths", q_index.float(), k_index.float())
    return torch.einsum("bth,bths->bts", weights.float(), torch.relu(logits))


def causal_topk(
    scores: torch.Tensor, *, q_positions: torch.Tensor, kv_lengths: torch.Tensor, top_k: int,
    pad_to_top_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible keys per query -> (indices long [B,T,K], valid bool [B,T,K]), K = min(top_k, S).

    scores [B,T,S] (no NaN); visibility as in `mla.visible_keys`. A query that sees n keys gets
    min(n, top_k) valid entries, so with n <= top_k every visible key is selected and DSA equals
    dense attention. Entries are ordered by descending score, ties broken by the lower slot, so
    the result is deterministic; invalid entries (beyond n) hold slot 0.

    `pad_to_top_k`: K = top_k at every S, the entries past S invalid like any other. The result
    then has one shape rule for every context, so a compiled graph holds one form instead of one
    per side of `selects_every_key` (serve's compiled decode asks for it).
    """
    _check_topk_args(scores, q_positions, top_k)
    num_keys = scores.shape[-1]
    if scores.numel() == 0:
        return causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=top_k)
    top = top_k if pad_to_top_k or not selects_every_key(num_keys, top_k) else num_keys
    counts = visible_counts(q_positions, kv_lengths, num_keys)
    keys = _selection_keys(scores, counts)
    if pad_to_top_k:  # top_k more keys below every real one: never valid, whatever S is
        keys = torch.cat([keys, keys.new_full((*keys.shape[:-1], top_k), _KEY_OF_PADDING)], dim=-1)
    # One torch.topk over keys that are all distinct, so its (otherwise unspecified) choice among
    # ties cannot matter: each key orders by score first, then by lower slot. Sorted output is
    # already the reference's order; no threshold check, no host read, no second pass, one graph.
    best = torch.topk(keys, top, dim=-1, sorted=True).values
    slots = _SLOT_MASK - (best & _SLOT_MASK)
    valid = torch.arange(top, device=scores.device) < counts[..., None]
    return slots.masked_fill(~valid, 0), valid


def selects_every_key(num_keys: int, top_k: int) -> bool:
    """Whether `causal_topk` over `num_keys` keys keeps them all (fewer than top_k): its output is
    then num_keys wide, else top_k wide. A compiler holds the two as different graphs; code that
    compiles ahead of time asks `causal_topk(pad_to_top_k=True)` for one width at every context."""
    return num_keys < top_k


# A selection key is int64: (score's order as int32) * 2^32 + (2^32 - 1 - slot).
_SLOT_MASK = (1 << 32) - 1
_SIGN_MASK = (1 << 31) - 1
_ORDER_OF_LOWEST = -0x7F7FFFFF  # order of the lowest finite float32; -inf's is one below it
_ORDER_HIDDEN = -(1 << 31)  # below every score's order
_KEY_OF_PADDING = _ORDER_HIDDEN * (1 << 32)  # a hidden key of a slot past every real one


def _selection_keys(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 [B, T, S] keys whose descending order is the reference's selection order: higher
    score first (visible -inf just above hidden keys), ties to the lower slot.

    A float32's bits read as int32 order like the float for non-negative values; for negative
    ones (sign bit set) -(bits without the sign) restores the order, and maps -0.0 to 0 like +0.0
    (they tie in the reference's sort too). No key collides, since every slot's differs."""
    bits = scores.float().contiguous().view(torch.int32)
    order = torch.where(bits >= 0, bits, -(bits & _SIGN_MASK)).clamp_(min=_ORDER_OF_LOWEST)
    slot = torch.arange(scores.shape[-1], device=scores.device)
    order = order.masked_fill(slot >= counts[..., None], _ORDER_HIDDEN)
    return order.long() * (1 << 32) + (_SLOT_MASK - slot)


def causal_topk_reference(
    scores: torch.Tensor, *, q_positions: torch.Tensor, kv_lengths: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable form of `causal_topk`: one stable sort of all S scores, keep the first K."""
    ranked, visible, top = _ranked_scores(scores, q_positions, kv_lengths, top_k)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :top]
    valid = torch.arange(top, device=scores.device) < visible.sum(dim=-1, keepdim=True)
    return order.masked_fill(~valid, 0), valid


def _ranked_scores(
    scores: torch.Tensor, q_positions: torch.Tensor, kv_lengths: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(fp32 scores with hidden keys at -inf, visible bool [B,T,S], K = min(top_k, S)).

    The order to select by: higher score first, ties to the lower slot (torch.topk's own tie
    order is unspecified). Visible scores are clamped to the lowest finite float so that hidden
    keys (-inf) rank strictly after every visible key, even a visible -inf one.
    """
    _check_topk_args(scores, q_positions, top_k)
    visible = visible_keys(q_positions, kv_lengths, scores.shape[-1])
    lowest = torch.finfo(torch.float32).min
    ranked = torch.where(visible, scores.float().clamp(min=lowest), float("-inf"))
    num_keys = scores.shape[-1]
    return ranked, visible, num_keys if selects_every_key(num_keys, top_k) else top_k


def _check_topk_args(scores: torch.Tensor, q_positions: torch.Tensor, top_k: int) -> None:
    if top_k <= 0:
        raise ValueError(f"top_k: expected a positive integer, got {top_k}")
    if scores.dim() != 3:
        raise ValueError(f"scores: expected shape [B, T, S], got {tuple(scores.shape)}")
    check_shape("q_positions", q_positions, "[B, T]", scores.shape[:2])


def topk_mask(indices: torch.Tensor, valid: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, T, S] with True at the valid selected slots: the `selected` argument of MLA."""
    if indices.dim() != 3:
        raise ValueError(f"indices: expected shape [B, T, K], got {tuple(indices.shape)}")
    check_shape("valid", valid, "[B, T, K]", tuple(indices.shape))
    batch, time, _ = indices.shape
    # Invalid entries go to an extra dump slot, so they can never clear a real selection.
    slots = indices.long().masked_fill(~valid, num_keys)
    mask = torch.zeros(batch, time, num_keys + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, slots, True)[..., :num_keys]
