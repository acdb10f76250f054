"""Blockwise-FP8 training linear against `ops.quant`'s reference, forward and both backward products."""

import pytest
import torch

from deltamoe.ops.fp8_linear import (ACT_TILE, WEIGHT_BLOCK, Fp8ErrorStats, fp8_linear, quantize_tiles,
                                     reference_forward, reference_grads)
from deltamoe.ops.quant import (dequantize_fp8_act, fp8_blockwise_matmul_reference, quantize_fp8_act,
                                quantize_fp8_blockwise)


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


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])  # a norm's output, another op's bf16 output
def test_autocast_rounds_the_fp32_product_once_like_scaled_mm(x_dtype):
    # An fp8 GEMM reads e4m3 operands, accumulates in fp32 and rounds its output once to bf16: inside a bf16
    # region the product must be the fp32 quant reference rounded once, with no bf16 operand or partial sum,
    # and the backward products (from the bf16 grad the region hands back) the fp32 reference as well.
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(70, 200, generator=g) * 3).to(x_dtype).requires_grad_()  # partial tiles on every dim
    w = (torch.randn(130, 200, generator=g) * 0.05).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w)
    dy = torch.randn(70, 130, generator=g).to(torch.bfloat16)
    y.backward(dy)
    x32 = x.detach().float()
    assert torch.equal(y.detach(), reference_forward(x32, w.detach()).to(torch.bfloat16))
    dx, dw = reference_grads(x32, w.detach(), dy.float())
    assert x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    assert torch.equal(x.grad, dx.to(x_dtype))
    torch.testing.assert_close(w.grad, dw, rtol=1e-6, atol=1e-5)


def _rel_rows(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (approx - exact).norm(dim=1) / exact.norm(dim=1)


def test_dgrad_and_wgrad_equal_the_quant_reference_built_independently():
    # dgrad as ops.quant's W8A8 product (dy per token in 1 x 128, W.T in W's 128 x 128 blocks); wgrad with
    # quantize_fp8_act tiling dy.T and x.T along tokens (128 x 1 tiles of dy and x), x from its forward e4m3 copy.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 256, generator=g, requires_grad=True)
    w = torch.randn(384, 256, generator=g, requires_grad=True)
    dy = torch.randn(300, 384, generator=g)
    fp8_linear(x, w).backward(dy)
    dy_fp8, dy_scale = quantize_fp8_act(dy)
    wt_fp8, wt_scale = quantize_fp8_blockwise(w.detach().t())
    dx = fp8_blockwise_matmul_reference(dy_fp8, wt_fp8, wt_scale, x_scale=dy_scale, out_dtype=torch.float32)
    torch.testing.assert_close(x.grad, dx, rtol=1e-6, atol=1e-5)
    x_fwd = dequantize_fp8_act(*quantize_fp8_act(x.detach()))
    pad = (0, 84)  # quantize_fp8_act needs whole tiles: 300 tokens padded to 384 with zeros (zeros change no scale)
    dyt = dequantize_fp8_act(*quantize_fp8_act(torch.nn.functional.pad(dy.t(), pad)))
    xt = dequantize_fp8_act(*quantize_fp8_act(torch.nn.functional.pad(x_fwd.t(), pad)))
    torch.testing.assert_close(w.grad, dyt @ xt.t(), rtol=1e-6, atol=1e-4)


def test_scales_follow_the_contraction_axis_per_token_and_per_feature():
    # Magnitudes spread over 10 decades across tokens, output features and input features: each gets its own
    # scale in the tiling above, so every row of y, dx and dW stays within e4m3's few-% error. A scale taken
    # over the wrong axis would share one scale across the decades and flush the small rows to zero.
    g = torch.Generator().manual_seed(2)
    spread = torch.logspace(-5, 5, 128)
    x = (torch.randn(128, 128, generator=g) * spread[:, None]).requires_grad_()  # tokens of every magnitude
    w = (torch.randn(128, 128, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(128, 128, generator=g) * spread[:, None]  # ... and their output gradients
    y = fp8_linear(x, w)
    y.backward(dy)
    assert _rel_rows(y.detach(), x.detach() @ w.detach().t()).max() < 0.1
    assert _rel_rows(x.grad, dy @ w.detach()).max() < 0.1
    # wgrad: output features (dy columns) of every magnitude; dy is tiled 128 x 1 along tokens there, one
    # scale per output feature and 128 tokens. (x's input features share the forward's 1 x 128 tiles, whose
    # e4m3 copy wgrad reuses, so their spread is bounded by one tile's range.)
    x2 = torch.randn(256, 128, generator=g, requires_grad=True)
    w2 = torch.randn(128, 128, generator=g, requires_grad=True)
    dy2 = torch.randn(256, 128, generator=g) * spread[None, :]
    fp8_linear(x2, w2).backward(dy2)
    assert _rel_rows(w2.grad, dy2.t() @ x2.detach()).max() < 0.1


def test_outliers_saturate_nothing_and_stay_finite():
    # A tile's absmax maps to e4m3's largest value (448), so even 1e30 outliers neither overflow to NaN nor clip.
    x = torch.randn(4, 256)
    x[0, 3], x[2, 200] = 1e30, -3e29
    w = torch.randn(64, 256) * 0.02
    w[5, 7] = 1e25
    y = fp8_linear(x, w)
    assert torch.isfinite(y).all()
    xq = quantize_tiles(x, ACT_TILE)
    assert xq.data.float().abs().max() == 448 and torch.isfinite(xq.data.float()).all()
    assert xq.dequantize()[0, 3] == pytest.approx(1e30, rel=1e-6)  # the absmax round-trips exactly


def test_master_weight_and_its_gradient_stay_full_precision():
    w = torch.nn.Parameter(torch.randn(64, 128) * 0.02)
    before = w.detach().clone()
    fp8_linear(torch.randn(8, 128), w).sum().backward()
    # The product quantises a copy: the fp32 master weight is untouched (not rounded to e4m3 in place).
    assert w.dtype == torch.float32 and w.grad.dtype == torch.float32 and torch.equal(w.detach(), before)
    assert not torch.equal(before, quantize_tiles(before, WEIGHT_BLOCK).dequantize())
