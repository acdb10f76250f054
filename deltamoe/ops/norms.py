"""Normalisations and the Block AttnRes mixer (spec §4, §4.1), as plain tensor functions.

All of them normalise in fp32 (as the reference does) and return the input dtype.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * cast(x * rsqrt(mean(x^2) + eps))`: normalise in fp32, cast back, then scale (HF/K3 order)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: per-head RMSNorm times sigmoid(gate), entirely in fp32, cast at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def attn_res_mix(current: torch.Tensor, bank: list[torch.Tensor], u: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes `Mix(p, B; u)`: softmax-weighted sum over [bank..., current] per token.

    The score of each candidate is <RMSNorm(V_j), u> with u = w_norm * w_proj; the mix uses the
    raw candidates (not the normalised keys), all in fp32, cast back to the input dtype.
    """
    values = torch.stack([b.float() for b in bank] + [current.float()], dim=-2)  # [..., n+1, D]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    probs = torch.softmax(keys @ u.float().reshape(-1, 1), dim=-2)  # [..., n+1, 1]
    return (probs * values).sum(-2).to(current.dtype)
