"""Mixture-of-experts ops: the sigmoid router and the local expert compute (spec §4.5).

`route_tokens` turns router logits into (weights, expert indices) exactly as transformers'
`KimiLinearTopkRouter` and NeMo's `KimiK3Gate` do. `experts_forward` runs the selected
experts with one matmul per expert over a contiguous, expert-sorted slice of tokens;
`experts_forward_reference` is the plain dense form the tests compare it with, and
`experts_forward_static` the routing-independent shapes a compiled decode graph holds (its
caller chooses it; `gathers_expert_weights` says which of its two forms a batch takes, and
`static_expert_form` whether a compiled graph should call the sorted form instead).

Both expert functions take the expert weights as stacked tensors in checkpoint layout:
`w1` (gate) and `w3` (up) are [E, I, D] and `w2` (down) is [E, D, I], so `x @ w1[e].T` is
the gate projection of expert e. A latent MoE (K3) calls them on the down-projected latent
(D = routed_expert_hidden_size); Kimi Linear calls them at hidden width.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deltamoe.ops.activations import glu


def _combine_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 so gradcheck-style tests are exact."""
    return torch.promote_types(x.dtype, torch.float32)


# `linear(x, w)` computes x @ w.T: the expert matmul, replaceable (blockwise-fp8 training passes its own).
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Added to the sum of the selected scores before renormalising, as transformers and NeMo do,
# so a row of all-zero scores gives zero weights instead of NaN.
RENORM_EPS = 1e-20


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    num_expert_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `top_k` experts per token and their combine weights.

    router_logits: [N, E], computed by the caller in fp32 (x_fp32 @ W_gate^T).
    correction_bias: [E] or None. The `noaux_tc` load-balancing bias: it shifts which
        experts are *selected* but never enters the weights, so balancing does not bias
        the output mix.
    num_expert_group / topk_group: DeepSeek-V3 group restriction. Each group is scored by
        the sum of its two best biased scores; only experts in the best `topk_group`
        groups may be selected. With one group (Kimi Linear, K3) this is a no-op.

    Returns weights fp32 [N, top_k] = sigmoid scores at the chosen experts, renormalised to
    sum to one when `renormalize`, times `scaling_factor`; and indices long [N, top_k].
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: expected [N, E], got shape {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if num_experts % num_expert_group != 0:
        raise ValueError(f"num_expert_group: expected a divisor of num_experts ({num_experts}), got {num_expert_group}")
    group_size = num_experts // num_expert_group
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group: expected 1..{num_expert_group}, got {topk_group}")
    # Masked-out groups are -inf; asking for more experts than the kept groups hold would
    # silently select masked ones.
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"top_k: expected 1..{topk_group * group_size} (experts in the kept groups), got {top_k}")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias: expected shape ({num_experts},), got {tuple(correction_bias.shape)}")

    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        if group_size < 2:
            raise ValueError(f"num_expert_group: groups need at least 2 experts, got {group_size}")
        grouped = choice.view(num_tokens, num_expert_group, group_size)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    # sorted=False as transformers does: the slot order is not part of the contract, and the
    # same order makes the renormalising sum bit-identical to the reference.
    indices = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * scaling_factor, indices


def _check_expert_args(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
) -> None:
    """Shape checks shared by both expert forms, with messages that name the tensor."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, D], got shape {tuple(x.shape)}")
    n, d = x.shape
    if w1.dim() != 3 or w1.shape[2] != d:
        raise ValueError(f"w1: expected [E, I, {d}], got shape {tuple(w1.shape)}")
    e, i, _ = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3: expected {tuple(w1.shape)} (same as w1), got {tuple(w3.shape)}")
    if w2.shape != (e, d, i):
        raise ValueError(f"w2: expected ({e}, {d}, {i}), got {tuple(w2.shape)}")
    if indices.dim() != 2 or indices.shape[0] != n:
        raise ValueError(f"indices: expected [{n}, k], got shape {tuple(indices.shape)}")
    if weights.shape != indices.shape:
        raise ValueError(f"weights: expected {tuple(indices.shape)} (same as indices), got {tuple(weights.shape)}")


def _grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` can run the experts: no autograd (its CPU backward fails on empty
    experts), a float dtype it supports, and rows of D and I values that are 16-byte multiples."""
    if torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not x.dtype == w1.dtype == w2.dtype:
        return False
    row_bytes = x.element_size()
    return (w1.shape[2] * row_bytes) % 16 == 0 and (w1.shape[1] * row_bytes) % 16 == 0


def _few_rows_on_cpu(x_sorted: torch.Tensor, w1: torch.Tensor) -> bool:
    """At most half as many (token, slot) rows as experts on a CPU (small-batch decode): torch's
    CPU grouped matmul walks every expert, empty or not, while the loop below touches only the
    experts that have rows but pays several dispatched ops for each; with more rows (a batch of
    a few tokens, a speculative verification) most experts have rows and the grouped call is cheaper."""
    return x_sorted.device.type == "cpu" and 2 * x_sorted.shape[0] <= w1.shape[0]


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    act: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    linear: Linear | None = None,
) -> torch.Tensor:
    """Weighted sum of the selected experts' outputs, grouped by expert.

    The N*k (token, slot) pairs are sorted by expert so each expert that received tokens
    runs three dense matmuls over one contiguous slice: the loop is over experts, never
    over tokens. Expert outputs stay in x.dtype (a bf16 model rounds each expert output to
    bf16, as K3 does); the weighted sum is taken in fp32 with `index_add`, which is also
    what makes the whole function differentiable w.r.t. x, weights and expert weights.

    The expert slices are sized on the host from the routing, so a compiled graph cannot hold
    this form: it calls `experts_forward_static` instead (the caller picks, see
    `model.ffn.local_experts_static`).

    Returns fp32 [N, D] (fp64 for fp64 inputs).
    """
    _check_expert_args(x, weights, indices, w1, w3, w2)
    num_tokens, top_k = indices.shape
    acc = _combine_dtype(x)
    out = x.new_zeros(num_tokens, x.shape[1], dtype=acc)
    flat_experts = indices.reshape(-1)
    if flat_experts.numel() == 0:
        return out
    order = torch.argsort(flat_experts, stable=True)
    token_of_slot = order // top_k  # token id of each expert-sorted (token, slot) pair
    counts = torch.bincount(flat_experts, minlength=w1.shape[0])
    y_sorted = _sorted_expert_outputs(x[token_of_slot], counts, w1, w3, w2, act, situ_beta, situ_linear_beta, linear)
    y_sorted = y_sorted.to(acc) * weights.reshape(-1)[order].to(acc).unsqueeze(-1)
    return out.index_add(0, token_of_slot, y_sorted)


def gathers_expert_weights(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Which form `experts_forward_static` takes for `num_tokens` rows: gathering each row's own
    experts' weights while there are fewer (token, slot) pairs than experts, else every expert on
    every row. The two are different graphs to a compiler, so code that compiles ahead of time
    (serve's compiled decode) asks this to find the batch sizes where the form changes."""
    return num_tokens * top_k < num_experts


# How many multiply-adds the all-experts form may add per expert (beyond the selected pairs' own)
# before the sorted form, with its three small matmuls per expert, is the cheaper one. Measured on
# one AVX-512 core (2026-12-04, full precision, sorted eager vs all-experts compiled): 64 experts of
# 256 x 256, top-8 (`small`): sorted 6.8 / 15.5 ms against 17.9 / 39.0 ms at 8 / 64 rows (1.4 / 11 M
# extra an expert); 16 of 64 x 96, top-4 (`tiny`): even at 32 rows (0.44 M), all-experts 2.5x
# slower at 128 (1.8 M); 8 of 64 x 32, top-2: even up to ~0.15-0.3 M.
ALL_EXPERTS_EXTRA_MACS_PER_EXPERT = 512 * 1024


def static_expert_form(num_tokens: int, top_k: int, num_experts: int, dim: int, inter: int,
                       extra_macs_per_expert: int | None = None) -> str:
    """How a compiled graph runs the experts for `num_tokens` rows of width `dim` (experts of `inter`
    hidden units): "gather" or "all", the two forms of `experts_forward_static`, or "sorted": the
    all-experts form would multiply more than it saves in per-expert calls, so the graph calls
    `experts_forward` as one opaque op (`ops.sorted_experts_op`). `extra_macs_per_expert`: the
    budget of the experts' format (default `ALL_EXPERTS_EXTRA_MACS_PER_EXPERT`, full precision;
    int4 stacks pass `ops.int4_experts.all_experts_budget()`)."""
    if gathers_expert_weights(num_tokens, top_k, num_experts):
        return "gather"
    budget = ALL_EXPERTS_EXTRA_MACS_PER_EXPERT if extra_macs_per_expert is None else extra_macs_per_expert
    extra = num_tokens * (num_experts - top_k) * 3 * dim * inter
    return "all" if extra <= num_experts * budget else "sorted"


def experts_forward_static(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    act: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """`experts_forward` with shapes that never depend on the routing: the form a compiled graph
    holds (the sorted form slices rows per expert by counts read back to the host).

    Fewer (token, slot) pairs than experts (small-batch decode) gather just their experts'
    weights; otherwise every expert runs on every row (E/k times the multiply-adds, each weight
    read once) and the combine keeps only the selected outputs, with `where` so an unselected
    expert's inf or NaN never leaks in. Meant for decode batches of small models, where per-op
    overhead, not arithmetic, bounds a step. Returns fp32 [N, D] (fp64 for fp64 inputs).
    """
    _check_expert_args(x, weights, indices, w1, w3, w2)
    num_tokens, top_k = indices.shape
    num_experts = w1.shape[0]
    acc = _combine_dtype(x)
    if gathers_expert_weights(num_tokens, top_k, num_experts):
        gate = torch.einsum("nd,nkid->nki", x, w1[indices])
        up = torch.einsum("nd,nkid->nki", x, w3[indices])
        y = torch.einsum("nki,nkdi->nkd", glu(gate, up, act, situ_beta, situ_linear_beta), w2[indices])
        return (y.to(acc) * weights.to(acc).unsqueeze(-1)).sum(1)
    combine = x.new_zeros(num_tokens, num_experts, dtype=acc).scatter_add_(1, indices, weights.to(acc))
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=x.device).scatter_(1, indices, True)
    _, inter, dim = w1.shape
    if x.dtype == acc:
        # Full precision: every expert's gate/up is one [N, E*I] matmul, and since the combine is
        # linear, weighting the hidden units first makes the down projections and their sum one
        # [N, E*I] @ [E*I, D] matmul (three matmuls a layer instead of three batched ones over E).
        gate = x @ w1.reshape(num_experts * inter, dim).t()
        up = x @ w3.reshape(num_experts * inter, dim).t()
        hidden = glu(gate, up, act, situ_beta, situ_linear_beta).view(num_tokens, num_experts, inter)
        hidden = torch.where(chosen.unsqueeze(-1), hidden * combine.unsqueeze(-1), 0)
        return hidden.view(num_tokens, -1) @ w2.transpose(1, 2).reshape(num_experts * inter, dim)
    # bf16 / fp16: each expert output is rounded to x.dtype before the weighted sum, as the sorted form does.
    hidden = glu(torch.matmul(x, w1.transpose(1, 2)), torch.matmul(x, w3.transpose(1, 2)), act, situ_beta,
                 situ_linear_beta)  # [E, N, I]
    y = torch.matmul(hidden, w2.transpose(1, 2)).to(acc)  # [E, N, D]
    return torch.where(chosen.t().unsqueeze(-1), y * combine.t().unsqueeze(-1), 0).sum(0)


def _sorted_expert_outputs(
    x_sorted: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
    act: str, situ_beta: float, situ_linear_beta: float, linear: Linear | None = None,
) -> torch.Tensor:
    """Each expert on its contiguous slice of the expert-sorted rows -> [N*k, D] in x.dtype
    (`linear`, when given, computes each expert matmul in the loop)."""
    if linear is None and _grouped_mm_applies(x_sorted, w1, w2) and not _few_rows_on_cpu(x_sorted, w1):
        # Inference: torch's grouped matmul runs every expert's slice in one call (the same
        # products as the loop below, which it equals exactly) and needs no host sync.
        ends = counts.cumsum(0).to(torch.int32)
        gate = F.grouped_mm(x_sorted, w1.transpose(1, 2), offs=ends)
        up = F.grouped_mm(x_sorted, w3.transpose(1, 2), offs=ends)
        return F.grouped_mm(glu(gate, up, act, situ_beta, situ_linear_beta), w2.transpose(1, 2), offs=ends)
    # One host sync for the slice boundaries; tokens per expert are data dependent anyway.
    slices, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            slices.append((expert, slice(start, start + count)))
            start += count
    mm = (lambda x, w: x @ w.T) if linear is None else linear
    # The activation is elementwise: one call over every expert's rows instead of one per expert
    # (at decode sizes each op's dispatch, not its arithmetic, is the cost).
    gate = torch.cat([mm(x_sorted[rows], w1[expert]) for expert, rows in slices])
    up = torch.cat([mm(x_sorted[rows], w3[expert]) for expert, rows in slices])
    hidden = glu(gate, up, act, situ_beta, situ_linear_beta)
    return torch.cat([mm(hidden[rows], w2[expert]) for expert, rows in slices])


def experts_forward_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    act: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """Readable dense form of `experts_forward`: for each of the k slots, gather every
    token's expert weights and apply them token by token (batched with einsum).

    Memory is N*I*D per slot, so it is only for tests and tiny shapes. Returns fp32 [N, D]
    (fp64 for fp64 inputs).
    """
    _check_expert_args(x, weights, indices, w1, w3, w2)
    acc = _combine_dtype(x)
    out = x.new_zeros(x.shape, dtype=acc)
    for slot in range(indices.shape[1]):
        expert = indices[:, slot]
        gate = torch.einsum("nd,nid->ni", x, w1[expert])
        up = torch.einsum("nd,nid->ni", x, w3[expert])
        hidden = glu(gate, up, act, situ_beta, situ_linear_beta)
        y = torch.einsum("ni,ndi->nd", hidden, w2[expert])  # stays in x.dtype, like the fast path
        out = out + weights[:, slot : slot + 1].to(acc) * y.to(acc)
    return out


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, long [num_experts]: the balance statistic that the
    correction-bias update and the EP all-to-all imbalance analysis read."""
    flat = indices.reshape(-1)
    # scatter_add rather than bincount: the same counts with a fixed output shape (a compiled graph
    # cannot hold bincount, whose length depends on the largest index).
    return torch.zeros(num_experts, dtype=torch.long, device=indices.device).scatter_add_(0, flat, torch.ones_like(flat))
