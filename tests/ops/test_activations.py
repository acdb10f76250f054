"""SiTU and SiLU-GLU against their formulas (spec §4.6)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deltamoe.ops.activations import glu, silu_glu, situ


def test_situ_matches_formula_pointwise() -> None:
    # Hand-evaluated with math.* so the test does not reuse the implementation's ops.
    pairs = [(0.0, 1.0), (1.0, 2.0), (-3.0, 0.5), (10.0, -40.0), (-7.5, 30.0)]
    gate = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    up = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    expected = [
        4.0 * math.tanh(a / 4.0) / (1.0 + math.exp(-a)) * 25.0 * math.tanh(b / 25.0) for a, b in pairs
    ]
    out = situ(gate, up)
    assert out.dtype == torch.float64
    # fp32 inside: agreement to fp32 precision, not fp64.
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=2e-6, atol=1e-6)


def test_situ_custom_betas() -> None:
    gate, up = torch.tensor([2.0]), torch.tensor([3.0])
    expected = 1.5 * math.tanh(2.0 / 1.5) / (1 + math.exp(-2.0)) * 2.0 * math.tanh(3.0 / 2.0)
    assert situ(gate, up, beta=1.5, linear_beta=2.0).item() == pytest.approx(expected, rel=1e-6)


def test_situ_is_swiglu_for_small_inputs() -> None:
    torch.manual_seed(0)
    gate = 0.05 * torch.randn(257)
    up = 0.05 * torch.randn(257)
    ref = F.silu(gate) * up
    # tanh(z) = z - z^3/3 + ...: relative deviation ~ (a/4)^2/3, i.e. ~1e-4 at |a| ~ 0.1.
    torch.testing.assert_close(situ(gate, up), ref, rtol=2e-3, atol=1e-7)


def test_situ_is_bounded_for_large_inputs() -> None:
    gate = torch.tensor([1e4, 50.0, -1e4])
    up = torch.tensor([1e4, -1e4, 1e4])
    out = situ(gate, up)
    # sigmoid -> 1 and both tanh -> +-1 for large positive gate; -> 0 for large negative gate.
    torch.testing.assert_close(out, torch.tensor([100.0, -100.0, 0.0]))
    assert out.abs().max() <= 4.0 * 25.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_situ_computes_in_fp32_and_returns_input_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    gate = (3 * torch.randn(64, 33)).to(dtype)
    up = (3 * torch.randn(64, 33)).to(dtype)
    out = situ(gate, up)
    assert out.dtype == dtype
    # One rounding of the fp32 result, not a product of rounded intermediates.
    assert torch.equal(out, situ(gate.float(), up.float()).to(dtype))


def test_silu_glu_and_dispatch() -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(silu_glu(gate, up), gate * torch.sigmoid(gate) * up)
    assert torch.equal(glu(gate, up, "silu"), silu_glu(gate, up))
    assert torch.equal(glu(gate, up, "situ", 2.0, 10.0), situ(gate, up, 2.0, 10.0))
    assert not torch.allclose(glu(gate, up, "situ"), glu(gate, up, "silu"))


def test_glu_unknown_kind_names_hidden_act() -> None:
    with pytest.raises(ValueError, match="hidden_act.*gelu"):
        glu(torch.ones(2), torch.ones(2), "gelu")


def test_situ_gradient() -> None:
    gate = torch.tensor([0.7, -1.2], dtype=torch.float64, requires_grad=True)
    up = torch.tensor([2.0, 0.3], dtype=torch.float64, requires_grad=True)
    situ(gate, up).sum().backward()
    a, b = 0.7, 2.0
    sig = 1 / (1 + math.exp(-a))
    d_gate = (1 - math.tanh(a / 4) ** 2) * sig + 4 * math.tanh(a / 4) * sig * (1 - sig)
    assert gate.grad[0].item() == pytest.approx(d_gate * 25 * math.tanh(b / 25), rel=1e-5)
    assert up.grad[0].item() == pytest.approx(4 * math.tanh(a / 4) * sig * (1 - math.tanh(b / 25) ** 2), rel=1e-5)
