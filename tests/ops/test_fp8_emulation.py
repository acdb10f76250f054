"""`ops.fp8_emulation` (e4m3 in fp32 arithmetic) against torch's float8 cast and `ops.quant`'s reference,
bit for bit, and the fp8 training linear on it against the same linear on the float8 reference."""

import pytest
import torch

from deltamoe.ops import fp8_linear as fp8_linear_module
from deltamoe.ops.fp8_emulation import (dequantize_fp8_blockwise_fp32, quantize_fp8_blockwise_fp32,
                                        round_to_e4m3)
from deltamoe.ops.fp8_linear import Fp8ErrorStats, fp8_linear
from deltamoe.ops.quant import FP8_DTYPE, dequantize_fp8_blockwise, quantize_fp8_blockwise


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit patterns, NaN where NaN (any NaN payload), so -0.0 differs from 0.0."""
    assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
    keep = ~a.isnan()
    diff = a[keep].view(torch.int32) != b[keep].view(torch.int32)
    assert not diff.any(), (a[keep][diff][:5], b[keep][diff][:5])


def _e4m3_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return codes[codes.isfinite()].unique()


def test_rounding_equals_the_float8_cast():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (400_000,), generator=g, dtype=torch.int64).to(torch.int32)
    random = bits.view(torch.float32)
    random = random[random.abs() <= 448]  # every binade, subnormal fp32 included
    grid = _e4m3_values()
    ties = (grid[1:] + grid[:-1]) / 2  # exact midpoints: ties to even
    up, down = torch.nextafter(ties, torch.tensor(1e9)), torch.nextafter(ties, torch.tensor(-1e9))
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-6, -2**-6, 2**-9, 2**-10, -2**-10, 3 * 2**-10,
                          2**-6 - 2**-30, 1e-45, -1e-45, float("nan")])
    values = torch.cat([random, grid, ties, up, down, edges])
    _assert_same_bits(round_to_e4m3(values), values.to(FP8_DTYPE).float())


@pytest.mark.parametrize("shape, block", [((37, 96), (1, 128)), ((64, 256), (1, 128)), ((200, 256), (128, 128)),
                                          ((256, 256), (128, 128)), ((130, 70), (128, 128))])
def test_blockwise_quantisation_equals_the_reference(shape, block):
    g = torch.Generator().manual_seed(shape[0])
    t = torch.randn(*shape, generator=g) * 10
    t[:3] = 0  # all-zero tiles (and an all-zero row's 1 x 128 tiles)
    t[5, :20] = -0.0
    t[6, 0] = 1e30  # one huge entry: the rest of its tile falls to zero or e4m3's subnormals
    t[7] *= 1e-38  # fp32-subnormal inputs
    t[8, 1] = float("inf")  # inf: its tile becomes NaN and zeros, as the reference's does
    t[9, 2] = float("nan")
    q_ref, s_ref = quantize_fp8_blockwise(t, block)
    q, s = quantize_fp8_blockwise_fp32(t, block)
    _assert_same_bits(q, q_ref.float())
    _assert_same_bits(s, s_ref)
    _assert_same_bits(dequantize_fp8_blockwise_fp32(q, s, block),
                      dequantize_fp8_blockwise(q_ref, s_ref, block, dtype=torch.float32))


def _run(x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    stats = Fp8ErrorStats()
    y = fp8_linear(x, w, stats)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, stats.take()


@pytest.mark.parametrize("n, k, m", [(37, 96, 130), (260, 200, 64), (128, 256, 384)])
def test_linear_is_bit_identical_to_the_float8_path(monkeypatch, n, k, m):
    g = torch.Generator().manual_seed(n)
    x, w, dy = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g) * 0.05, torch.randn(n, m, generator=g)
    x[:, :64] *= 1e-6  # small entries next to large ones in a tile: e4m3 subnormals
    x[:2] = 0
    w[:64, :64] = 0  # an all-zero weight block (partial or full)
    dy[1] *= 1e-30
    dy[2, 0] = 1e30  # a saturating entry
    fast = _run(x, w, dy)
    # The float8 path: tiles stored as float8_e4m3fn and dequantised by `ops.quant` (what a GPU emulates).
    monkeypatch.setattr(fp8_linear_module, "quantize_fp8_blockwise_fp32", quantize_fp8_blockwise)
    reference = _run(x, w, dy)
    for a, b in zip(fast[:3], reference[:3]):
        _assert_same_bits(a, b)
    assert fast[3] == reference[3] and set(fast[3]) == {"x", "w", "dy"}
