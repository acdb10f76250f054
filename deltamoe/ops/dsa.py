"""DeepSeek Sparse Attention (DSA): lightning-indexer scores and the causal top-k.

The indexer scores every visible key cheaply; each query then runs MLA over only its
top-k keys (`mla.mla_attention(..., selected=topk_mask(...))` for prefill, or
`mla.mla_attention_absorbed_sparse(..., indices, valid)` for decode). Visibility (causality
and per-row lengths) is `mla.visible_keys`, so the indexer and the attention agree on it.

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
    scores: torch.Tensor, *, q_positions: torch.Tensor, kv_lengths: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible keys per query -> (indices long [B,T,K], valid bool [B,T,K]), K = min(top_k, S).

    scores [B,T,S] (no NaN); visibility as in `mla.visible_keys`. A query that sees n keys gets
    min(n, top_k) valid entries, so with n <= top_k every visible key is selected and DSA equals
    dense attention. Entries are ordered by descending score, ties broken by the lower slot, so
    the result is deterministic; invalid entries (beyond n) hold slot 0.
    """
    ranked, counts, top = _ranked_prefix(scores, q_positions, kv_lengths, top_k)
    batch, time, _ = ranked.shape
    if top == 0 or batch * time == 0:
        return causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=top_k)
    # The same selection as the reference's full sort, in O(S). torch.topk finds the `top` largest
    # scores but picks arbitrarily among ties at the smallest of them (the threshold). Unless some
    # tied key was left out, its set is the reference's; a row that sees fewer than `top` keys
    # (threshold -inf) holds every visible key, and what fills it up is masked below.
    values, slots = torch.topk(ranked, top, dim=-1, sorted=False)
    threshold = values.min(dim=-1, keepdim=True).values
    # The check reads back a flag: on CPUs only, and never inside a compiled graph (which cannot
    # branch on data); the pass below then always runs, with the same result.
    settled = ranked.device.type == "cpu" and not torch.compiler.is_compiling() and bool(
        ((threshold.squeeze(-1) == float("-inf"))
         | ((ranked == threshold).sum(dim=-1) == (values == threshold).sum(dim=-1))).all())
    if not settled:
        slots = _lowest_slots_at_threshold(ranked, threshold, top)
    slots = slots.sort(dim=-1).values  # ascending slot, so the stable sort below breaks ties by slot
    order = torch.sort(ranked.gather(-1, slots), dim=-1, descending=True, stable=True).indices
    valid = torch.arange(top, device=scores.device) < counts[..., None]
    return slots.gather(-1, order).masked_fill(~valid, 0), valid


def _lowest_slots_at_threshold(ranked: torch.Tensor, threshold: torch.Tensor, top: int) -> torch.Tensor:
    """Exactly `top` slots per row: every key above the threshold, then the lowest slots among the
    ties at it -> long [B, T, top] in ascending slot order."""
    batch, time, _ = ranked.shape
    above = ranked > threshold
    tie = ranked == threshold
    room = top - above.sum(dim=-1, keepdim=True)
    keep = above | (tie & (tie.cumsum(dim=-1) <= room))
    # Scatter each kept slot to its rank among the kept ones; dropped slots go to a spill column.
    # Shapes never depend on the data, so meta-device tracing (pipeline stages infer their output
    # shapes that way) sees the real [B,T,top].
    rank = torch.where(keep, keep.cumsum(dim=-1) - 1, top)
    arange = torch.arange(ranked.shape[-1], device=ranked.device).expand_as(ranked)
    return ranked.new_zeros((batch, time, top + 1), dtype=torch.long).scatter_(-1, rank, arange)[..., :top]


def _ranked_prefix(
    scores: torch.Tensor, q_positions: torch.Tensor, kv_lengths: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`_ranked_scores` in fewer passes: the keys a query sees are a prefix of the slots
    (`mla.visible_counts`), so one comparison masks the rest.
    Returns (ranked fp32 [B,T,S], visible keys per query long [B,T], K)."""
    _check_topk_args(scores, q_positions, top_k)
    num_keys = scores.shape[-1]
    top = min(top_k, num_keys)
    counts = visible_counts(q_positions, kv_lengths, num_keys)
    lowest = torch.finfo(torch.float32).min
    ranked = scores.float().clamp(min=lowest)
    ranked.masked_fill_(torch.arange(num_keys, device=scores.device) >= counts[..., None], float("-inf"))
    return ranked, counts, top


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
    return ranked, visible, min(top_k, scores.shape[-1])


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
