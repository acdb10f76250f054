"""Routed experts whose weights stay packed: each expert's weights are unpacked (or fed to a
4-bit kernel) only when tokens are routed to it.

`experts_forward_by_expert` is `ops.moe.experts_forward`'s expert-sorted loop with the
per-expert MLP handed in as a function, so the caller decides how an expert's packed
weights are used. The reference it is tested against is `experts_forward_reference` on the
fully dequantised expert stack.
"""

from __future__ import annotations

from typing import Callable

import torch

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]  # (expert id, rows [n, D]) -> [n, D]


def experts_forward_by_expert(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, num_experts: int,
                              expert_mlp: ExpertMLP) -> torch.Tensor:
    """Weighted sum of the selected experts' outputs -> fp32 [N, D] (fp64 for fp64 x).

    The N*k (token, slot) pairs are sorted by expert; each expert that received rows runs
    `expert_mlp` once on its contiguous slice, so an unused expert is never unpacked.
    """
    if x.dim() != 2 or indices.shape != weights.shape or indices.shape[0] != x.shape[0]:
        raise ValueError(f"x [N, D], weights and indices [N, k]: got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)}, {tuple(indices.shape)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(x.shape, dtype=acc)
    flat = indices.reshape(-1)
    if flat.numel() == 0:
        return out
    top_k = indices.shape[1]
    order = torch.argsort(flat, stable=True)
    token_of_slot = order // top_k
    x_sorted = x[token_of_slot]
    outputs = []
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            outputs.append(expert_mlp(expert, x_sorted[start:start + count]))
            start += count
    y = torch.cat(outputs).to(acc) * weights.reshape(-1)[order].to(acc).unsqueeze(-1)
    return out.index_add(0, token_of_slot, y)
