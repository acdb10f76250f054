"""The norms against their formulas written out (fp32 runs torch's rms_norm; bf16 keeps HF's order)."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.norms import attn_res_mix, attn_res_mix_slots, gated_rms_norm, rms_norm


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_slots_equals_the_mix_of_its_live_slots(dtype) -> None:
    """Slots that are not live weigh 0 whatever they hold; the live ones mix as `attn_res_mix`."""
    g = torch.Generator().manual_seed(2)
    bank = (torch.randn(3, 1, 5, 24, generator=g) * 4).to(dtype)
    current, u = torch.randn(3, 1, 24, generator=g).to(dtype), torch.randn(24, generator=g)
    for live_slots in ([], [0], [1, 3], [0, 1, 2, 3, 4]):
        live = torch.tensor([j in live_slots for j in range(5)] + [True])
        want = attn_res_mix(current, [bank[..., j, :] for j in live_slots], u, 1e-5)
        got = attn_res_mix_slots(current, bank, live, u, 1e-5)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # no live slot: the current value itself, as the layer's `if bank else p` takes it
    torch.testing.assert_close(attn_res_mix_slots(current, bank, torch.tensor([False] * 5 + [True]), u, 1e-5),
                               current, rtol=0, atol=0)
