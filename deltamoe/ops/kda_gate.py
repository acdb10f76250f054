"""KDA inputs: the per-channel decay gate (both formulas) and the short causal depthwise conv.

Decay gate (spec §4.2), from f = f_b(f_a(x)) [B, T, H*K] before dt_bias, with a_h = exp(A_log[h]):
- "softplus" (Kimi Linear):  g = -a_h * softplus(f + dt_bias)          g in (-inf, 0]
- "lower_bound" (K3):        g = lower_bound * sigmoid(a_h * (f + dt_bias))  g in (lower_bound, 0)
Both run in fp32 and return g [B, T, H, K], the log-decay that `deltamoe.ops.kda` consumes.

Short conv: q, k and v each pass through a depthwise causal conv of width W (4) before SiLU. Its
decode state is the last W-1 inputs per channel, so prefill, chunked prefill and one-token decode
all go through the same function.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

GateKind = Literal["softplus", "lower_bound"]
GATE_KINDS: tuple[str, ...] = ("softplus", "lower_bound")

# softplus(x) == x above this (torch's default threshold, also transformers' explicit cut-off).
SOFTPLUS_THRESHOLD = 20.0


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    kind: GateKind,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Log-decay g [B, T, H, K] (fp32) from the low-rank gate projection f [B, T, H*K].

    A_log holds one value per head in any shape ([H], [1, 1, H, 1]); dt_bias has H*K values.
    """
    if kind not in GATE_KINDS:
        raise ValueError(f"kind: expected one of {GATE_KINDS}, got {kind!r}")
    if f.dim() != 3 or num_heads < 1 or f.shape[-1] % num_heads != 0:
        raise ValueError(f"f: expected shape [B, T, H*K] with H = {num_heads}, got {tuple(f.shape)}")
    head_dim = f.shape[-1] // num_heads
    if A_log.numel() != num_heads:
        raise ValueError(f"A_log: expected {num_heads} values (one per head), got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != f.shape[-1]:
        raise ValueError(f"dt_bias: expected {f.shape[-1]} values (H*K), got shape {tuple(dt_bias.shape)}")

    z = (f.float() + dt_bias.float().reshape(-1)).unflatten(-1, (num_heads, head_dim))
    decay_rate = A_log.float().reshape(num_heads, 1).exp()  # a_h, broadcast over K
    if kind == "softplus":
        return -decay_rate * F.softplus(z, threshold=SOFTPLUS_THRESHOLD)
    return lower_bound * torch.sigmoid(decay_rate * z)


def _conv_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Accept [C, W] or the nn.Conv1d layout [C, 1, W]; return [C, W]."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight: expected shape [C, W] or [C, 1, W] with C = {channels}, got {tuple(weight.shape)}")
    return weight


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: Literal["silu"] | None = "silu",
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv along time, continuing from `state`; no bias.

    x [B, T, C]; weight [C, W] or [C, 1, W]; state [B, C, W-1] = the last W-1 inputs before x
    (zeros when None). y_t = act(sum_w weight[c, w] * x_{t - (W-1) + w}).
    Returns (y [B, T, C] in x.dtype, new_state [B, C, W-1] = the last W-1 inputs, old state
    included when T < W-1; a transposed view of a contiguous [B, W-1, C], the serving cache's
    layout). Computes in weight.dtype, as transformers' fallback does.
    lengths [B] (optional): rows are right-padded and only their first lengths[b] inputs are
    real; new_state is then the W-1 inputs before each row's real end (y at padding is junk).
    """
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [B, T, C], got {tuple(x.shape)}")
    batch, _, channels = x.shape
    weight = _conv_weight(weight, channels)
    width = weight.shape[-1]
    if activation not in ("silu", None):
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    if state is None:
        state = x.new_zeros(batch, channels, width - 1)
    elif tuple(state.shape) != (batch, channels, width - 1):
        raise ValueError(
            f"state: expected shape [B, C, W-1] = ({batch}, {channels}, {width - 1}), got {tuple(state.shape)}"
        )

    # Time-major throughout ([B, time, C], channels innermost): x comes that way, the serving cache
    # stores its conv states that way ([slot, W-1, C]; `state` is then a transposed view of that),
    # and every product below runs over contiguous channels. (Channel-major windows made a compiled
    # decode step gather and scatter the states element by element.)
    window = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    if x.shape[1] == 0:
        return x, window.transpose(1, 2)
    # W shifted multiply-adds rather than a depthwise F.conv1d: at decode ~10x cheaper than the call,
    # and oneDNN's depthwise conv is erratic on CPUs: 1.5 ms for [31, 192, 67] against 0.34 ms
    # shifted, 3.1 against 0.9 ms at [8, 192, 515], while [33, 192, 35] runs 0.14 against 0.2 ms
    # (forward; forward + backward measured within +-20 % of each other).
    # Accumulated in place: one temporary per tap instead of two; no product's backward reads the
    # sum. A product then a sum, not addcmul_: its fused multiply-add rounds differently on
    # vectorised and strided inputs, and the result must not depend on the input's layout.
    win, t, taps = window.to(weight.dtype), x.shape[1], weight.t()  # taps [W, C]
    y = win[:, :t] * taps[0]
    for w in range(1, width):
        y.add_(win[:, w:w + t] * taps[w])
    if activation == "silu":
        y = F.silu(y)
    if lengths is None:
        new_state = window[:, window.shape[1] - (width - 1) :].contiguous()  # do not pin the whole window
    else:  # window position lengths[b] + j holds the j-th of the last W-1 real inputs
        rows = lengths.to(window.device)[:, None] + torch.arange(width - 1, device=window.device)
        new_state = window.gather(1, rows[:, :, None].expand(batch, width - 1, channels))
    return y.to(x.dtype), new_state.transpose(1, 2)
