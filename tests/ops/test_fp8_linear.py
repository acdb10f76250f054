"""Blockwise-FP8 training linear against `ops.quant`'s reference, forward and both backward products."""

import pytest
import torch

from deltamoe.ops.fp8_linear import (ACT_TILE, WEIGHT_BLOCK, Fp8ErrorStats, fp8_linear, quantize_tiles,
                                     reference_forward, reference_grads)
from deltamoe.ops.quant import fp8_blockwise_matmul_reference, quantize_fp8_act, quantize_fp8_blockwise


def test_forward_equals_the_quant_reference_w8a8():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 256, generator=g) * 3
    w = torch.randn(200, 256, generator=g) * 0.02  # 200: a partial 128-row block
    y = fp8_linear(x, w)
    x_fp8, x_scale = quantize_fp8_act(x.reshape(-1, 256))
    w_fp8, w_scale = quantize_fp8_blockwise(w)
    ref = fp8_blockwise_matmul_reference(x_fp8, w_fp8, w_scale, x_scale=x_scale, out_dtype=torch.float32)
    torch.testing.assert_close(y.reshape(-1, 200), ref, rtol=1e-6, atol=1e-6)
    assert (y - x @ w.T).abs().max() > 0  # it does quantise


@pytest.mark.parametrize("n, k, m", [(37, 96, 130), (260, 200, 64)])  # odd sizes: partial tiles on every dim
def test_backward_quantises_dgrad_and_wgrad_operands(n, k, m):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, k, generator=g, requires_grad=True)
    w = torch.randn(m, k, generator=g, requires_grad=True)
    dy = torch.randn(n, m, generator=g)
    stats = Fp8ErrorStats()
    y = fp8_linear(x, w, stats)
    y.backward(dy)
    torch.testing.assert_close(y.detach(), reference_forward(x.detach(), w.detach()), rtol=1e-6, atol=1e-5)
    dx, dw = reference_grads(x.detach(), w.detach(), dy)
    torch.testing.assert_close(x.grad, dx, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w.grad, dw, rtol=1e-6, atol=1e-5)
    # Close to the exact gradients (e4m3 has 3 mantissa bits: ~2-4 % relative error per operand) but not equal.
    exact_dw = dy.T @ x.detach()
    rel = ((w.grad - exact_dw).norm() / exact_dw.norm()).item()
    assert 1e-4 < rel < 0.08
    errs = stats.take()
    assert set(errs) == {"x", "w", "dy"} and all(0.005 < v < 0.05 for v in errs.values())
    assert stats.take() == {}


def test_tiles_follow_the_deepseek_v3_layout():
    x = torch.randn(5, 256)
    assert quantize_tiles(x, ACT_TILE).scale.shape == (5, 2)
    assert quantize_tiles(torch.randn(300, 256), WEIGHT_BLOCK).scale.shape == (3, 2)


def test_autocast_output_dtype_and_fp32_grads():
    x = torch.randn(4, 128, requires_grad=True)
    w = torch.randn(64, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
