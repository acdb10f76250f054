"""Normalisations and the Block AttnRes mixer (spec §4, §4.1), as plain tensor functions.

All of them normalise in fp32 (as the reference does) and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * cast(x * rsqrt(mean(x^2) + eps))`: normalise in fp32, cast back, then scale (HF/K3 order)."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # All fp32, so the casts are no-ops: torch's own rms_norm is this formula in one call.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: per-head RMSNorm times sigmoid(gate), entirely in fp32, cast at the end."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def attn_res_mix(current: torch.Tensor, bank: list[torch.Tensor], u: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes `Mix(p, B; u)`: softmax-weighted sum over [bank..., current] per token.

    The score of each candidate is <RMSNorm(V_j), u> with u = w_norm * w_proj; the mix uses the
    raw candidates (not the normalised keys), all in fp32, cast back to the input dtype.
    """
    values = torch.stack([b.float() for b in bank] + [current.float()], dim=-2)  # [..., n+1, D]
    return _mix(values, None, u, eps).to(current.dtype)


def attn_res_mix_slots(current: torch.Tensor, bank: torch.Tensor, live: torch.Tensor, u: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """`attn_res_mix` over a bank of fixed size: bank [..., S, D] with the banked values in some of
    its slots (finite values in the others), live [S + 1] bool marking the slots the mix reads and,
    last, `current` (always read). A slot that is not live scores -inf and weighs exactly 0, so this
    is `attn_res_mix(current, [bank[..., j, :] for live j], u, eps)`; the shapes are those of every
    layer, whatever its bank holds (one compiled graph serves them all)."""
    values = torch.cat([bank.float(), current.float().unsqueeze(-2)], dim=-2)  # [..., S+1, D]
    return _mix(values, live, u, eps).to(current.dtype)


def _mix(values: torch.Tensor, live: torch.Tensor | None, u: torch.Tensor, eps: float) -> torch.Tensor:
    """values [..., n, D] fp32 -> their softmax(<RMSNorm(v), u>)-weighted sum [..., D]; candidates
    where `live` [n] is False score -inf (weigh exactly 0)."""
    keys = F.rms_norm(values, (values.shape[-1],), None, eps)
    scores = keys @ u.float().reshape(-1, 1)  # [..., n, 1]
    if live is not None:
        scores = scores.masked_fill(~live.reshape(-1, 1), float("-inf"))
    return (torch.softmax(scores, dim=-2) * values).sum(-2)
