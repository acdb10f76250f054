"""Gated activations of the FFNs: SiLU-GLU (Kimi Linear) and SiTU (Kimi K3, spec §4.6).

Both take the two halves of a gated MLP, `gate = W1 x` and `up = W3 x`, and return the
input of the down projection. `glu` picks one by the config's `hidden_act`, so the dense
MLP, the shared experts and the routed experts share one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GLU_KINDS = ("silu", "situ")


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU(a, b) = beta*tanh(a/beta)*sigmoid(a) * linear_beta*tanh(b/linear_beta).

    A soft-capped SiLU times a soft-capped linear term: for |a| << beta and |b| << linear_beta
    it is SwiGLU, while the caps bound the product (|SiTU| < beta*linear_beta) so QAT with
    4-bit experts does not see activation outliers. K3 evaluates it in fp32 and casts the
    result back, so a bf16 model rounds once, after the whole product.
    """
    a = gate.float()
    b = up.float()
    capped_silu = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    capped_linear = linear_beta * torch.tanh(b / linear_beta)
    return (capped_silu * capped_linear).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, in the input dtype (as transformers' KimiLinear does)."""
    return F.silu(gate) * up


def glu(
    gate: torch.Tensor,
    up: torch.Tensor,
    kind: str,
    beta: float = 4.0,
    linear_beta: float = 25.0,
) -> torch.Tensor:
    """The gated activation named by `hidden_act`: "silu" (SwiGLU) or "situ"."""
    if kind == "silu":
        return silu_glu(gate, up)
    if kind == "situ":
        return situ(gate, up, beta, linear_beta)
    raise ValueError(f"hidden_act: expected one of {GLU_KINDS}, got {kind!r}")
