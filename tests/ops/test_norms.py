"""The norms against their formulas written out (fp32 runs torch's rms_norm; bf16 keeps HF's order)."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.norms import attn_res_mix, gated_rms_norm, rms_norm


def formula(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 1, 7), (2, 4, 3, 16)])
def test_rms_norm_fp32_equals_the_formula(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), w * formula(x, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, None, 1e-6), formula(x, 1e-6), rtol=1e-6, atol=1e-6)


def test_rms_norm_bf16_casts_before_the_weight() -> None:
    """HF / K3 order: normalise in fp32, round to bf16, then multiply by the (bf16) weight."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 32, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), w * formula(x, 1e-6).bfloat16())


def test_gated_rms_norm_and_attn_res_mix_equal_their_formulas() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, gate = torch.randn(2, 3, 4, 8, generator=g), torch.randn(8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    torch.testing.assert_close(gated_rms_norm(x, w, gate, 1e-5), formula(x, 1e-5) * w * torch.sigmoid(gate),
                               rtol=1e-6, atol=1e-6)
    bank, current, u = [torch.randn(2, 3, 16, generator=g) for _ in range(3)], torch.randn(2, 3, 16, generator=g), \
        torch.randn(16, generator=g)
    values = torch.stack([*bank, current], dim=-2)
    probs = torch.softmax((formula(values, 1e-5) * u).sum(-1, keepdim=True), dim=-2)
    torch.testing.assert_close(attn_res_mix(current, bank, u, 1e-5), (probs * values).sum(-2), rtol=1e-5, atol=1e-6)
