"""Rotary position embedding (non-interleaved, "rotate half").

Only the RoPE variant of MLA needs this (DeepSeek-style q_pe / k_pe). Kimi Linear and K3
are NoPE: their callers skip rotation entirely and pass q_pe / k_pe through unchanged.

Convention (transformers' `rotate_half`): the last dim is split into two halves
(x1 | x2) and pair i is (x1[i], x2[i]), rotated by angle pos * theta^(-2i/dim). Checkpoints
stored in the interleaved layout (pairs are (x[2i], x[2i+1]), as DeepSeek-V3's MLA) give
the same dot products after permuting their rope rows to [even | odd]; that permutation
belongs to the weight loader, not here.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for absolute `positions` [B, T] (long) -> two fp32 [B, T, dim].

    Angles are computed in fp32 (after an fp64 inverse-frequency table) because long contexts
    lose whole radians in bf16; callers cast the rotated result, not the table.
    """
    if positions.dim() != 2:
        raise ValueError(f"positions: expected shape [B, T], got {tuple(positions.shape)}")
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim: expected a positive even rotary dim, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim
    inv_freq = (1.0 / (theta**exponents)).float()  # [dim/2]
    angles = positions.float()[..., None] * inv_freq  # [B, T, dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # both halves of a pair share one angle
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, T, ..., dim] (e.g. q_pe [B,T,H,Dr] or k_pe [B,T,Dr]) by cos/sin.

    cos/sin are the [B, T, dim] tables of `rope_cos_sin`, or those tables already unsqueezed
    to x's rank (e.g. [B, T, 1, dim] for q_pe); they broadcast over the head dims. The math
    runs in fp32 and the result is cast back to x.dtype.
    """
    if x.dim() < 3:
        raise ValueError(f"x: expected shape [B, T, ..., dim], got {tuple(x.shape)}")
    batch, time, dim = x.shape[0], x.shape[1], x.shape[-1]
    if dim % 2:
        raise ValueError(f"x: expected an even last dim (rotary pairs), got {tuple(x.shape)}")
    view = (batch, time) + (1,) * (x.dim() - 3) + (dim,)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (batch, time, dim) and tuple(table.shape) != view:
            expected = f"[B, T, dim] = {(batch, time, dim)} or {view}"
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(table.shape)}")
    cos, sin = cos.float().reshape(view), sin.float().reshape(view)
    xf = x.float()
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2 :]
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated_half * sin).to(x.dtype)
