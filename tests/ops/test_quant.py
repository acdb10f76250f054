"""Quantisation formats (spec §6): hand-built bytes, round trips, shape errors."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.quant import (
    E2M1_VALUES,
    bytes_per_param,
    dequantize_fp8_act,
    dequantize_fp8_blockwise,
    dequantize_int4,
    dequantize_mxfp4,
    fp8_blockwise_matmul_reference,
    quantize_fp8_act,
    quantize_fp8_blockwise,
    quantize_int4,
    quantize_mxfp4,
)

# ----------------------------------------------------------------------------- MXFP4


def test_mxfp4_hand_built_bytes() -> None:
    # Row 0, group 0 (scale 2^0): byte 0x21 -> low nibble 1 (+0.5) first, high nibble 2 (+1.0).
    # byte 0xF8 -> low 0x8 (-0), high 0xF (-6).  byte 0x7C -> low 0xC (-2), high 0x7 (+6).
    # Row 0, group 1 (scale 2^-3): byte 0x53 -> 1.5, 3 scaled by 1/8.
    # Row 1: scales 2^4 and 2^-127 (E8M0 s=0): byte 0x9E -> -4, -0.5.
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 2] = 0x21, 0xF8, 0x7C
    packed[0, 16] = 0x53
    packed[1, 0] = 0x9E
    packed[1, 16] = 0x07
    scale = torch.tensor([[127, 124], [131, 0]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    assert w.shape == (2, 64)
    assert w[0, :6].tolist() == [0.5, 1.0, -0.0, -6.0, -2.0, 6.0]
    assert w[0, 32:34].tolist() == [1.5 / 8, 3.0 / 8]
    assert w[1, :2].tolist() == [-4.0 * 16, -0.5 * 16]
    assert w[1, 32:34].tolist() == [6.0 * 2.0**-127, 0.0]
    # Everything not set above decodes to zero.
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[0, :6] = mask[0, 32:34] = mask[1, :2] = mask[1, 32:34] = False
    assert bool((w[mask] == 0).all())


def test_mxfp4_all_codes_and_extreme_scales() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(3, 4)  # [3, 32] -> 64 columns
    scale = torch.tensor([[127, 127], [1, 1], [254, 254]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    table = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert w[0, :16].tolist() == table
    assert w[1, :16].tolist() == [v * 2.0**-126 for v in table]
    # 2 * 2^127 is past fp32's max: E8M0's top scales only make sense for tiny codes.
    assert w[2, 1:5].tolist() == [0.5 * 2.0**127, 2.0**127, 1.5 * 2.0**127, float("inf")]
    assert dequantize_mxfp4(packed[:1], scale[:1]).dtype == torch.bfloat16


def representable_mxfp4(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random e2m1 values with a random power-of-two scale per group of 32."""
    g = torch.Generator().manual_seed(seed)
    table = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
    values = table[torch.randint(0, 16, (rows, cols), generator=g)]
    exps = torch.randint(-20, 20, (rows, cols // 32, 1), generator=g).float()
    return (values.view(rows, -1, 32) * 2.0**exps).view(rows, cols)


def test_mxfp4_round_trip_is_exact_on_representable_values() -> None:
    w = representable_mxfp4(9, 96, seed=0)
    w[3, 32:64] = 0.0  # an all-zero group
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (9, 48) and packed.dtype == torch.uint8
    assert scale.shape == (9, 3) and scale.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(packed, scale, dtype=torch.float32), w)
    assert torch.equal(dequantize_mxfp4(packed, scale), w.to(torch.bfloat16))
    # Packed bytes that decode to themselves re-encode to the same values.
    again = dequantize_mxfp4(*quantize_mxfp4(dequantize_mxfp4(packed, scale, torch.float32)), torch.float32)
    assert torch.equal(again, w)


def test_mxfp4_quantize_scale_and_rounding() -> None:
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([12.0, 2.4, -0.6, 5.0, 1.25, 7.0])  # max 12 -> scale 2^1
    packed, scale = quantize_mxfp4(w)
    assert scale.item() == 128
    d = dequantize_mxfp4(packed, scale, torch.float32)[0, :6]
    # /2: 6, 1.2->1, -0.3->-0.5, 2.5 (tie 2|3 -> even code 2.0), 0.625->0.5, 3.5 (tie 3|4 -> 4)
    assert d.tolist() == [12.0, 2.0, -1.0, 4.0, 1.0, 8.0]


def test_mxfp4_random_error_is_bounded() -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    d = dequantize_mxfp4(*quantize_mxfp4(w), dtype=torch.float32)
    amax = w.view(16, 4, 32).abs().amax(-1, keepdim=True)
    # The scale 2^e puts amax/2^e in (3, 6]: the error is at most half a step, i.e. 1*2^e < amax/4
    # when values reach the 4..6 step, else 0.5*2^e < amax/6.
    err = (d - w).view(16, 4, 32).abs() / amax
    assert err.max() <= 0.25


def test_mxfp4_shape_errors_name_the_tensor() -> None:
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_scale.*\(4, 1\)"):
        dequantize_mxfp4(packed, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_scale.*uint8"):
        dequantize_mxfp4(packed, torch.zeros(4, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="weight_packed"):
        dequantize_mxfp4(torch.zeros(4, 15, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed"):
        dequantize_mxfp4(packed.to(torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="w:"):
        quantize_mxfp4(torch.zeros(4, 48))


# ------------------------------------------------------------------------------ INT4


def test_int4_hand_built_and_round_trip() -> None:
    q = torch.tensor([[-8, 7, -1, 0, 3, -3] + [0] * 122 + [1, 2] + [0] * 126])  # [1, 256]
    scale = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)
    w = q.float() * scale.float().repeat_interleave(128, dim=1)
    packed, s = quantize_int4(w)
    assert packed.shape == (1, 128) and s.shape == (1, 2) and s.dtype == torch.bfloat16
    # Scales are absmax/7: 8*0.5/7 and 2*0.25/7, so re-derive the codes from them.
    d = dequantize_int4(packed, s, dtype=torch.float32)
    torch.testing.assert_close(d, w, rtol=0, atol=s.float().max().item() / 2)
    # Byte layout: first element in the low nibble, two's complement.
    packed = torch.tensor([[0x78, 0xF0]], dtype=torch.uint8).repeat(1, 64)  # (-8, 7), (0, -1)
    d = dequantize_int4(packed, torch.tensor([[2.0, 2.0]], dtype=torch.bfloat16), dtype=torch.float32)
    assert d[0, :4].tolist() == [-16.0, 14.0, 0.0, -2.0]


def test_int4_exact_on_representable_values() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-7, 8, (5, 384), generator=g).float()
    q[:, ::128] = 7.0  # each group's absmax is 7*scale, so absmax/7 recovers the scale exactly
    scale = (torch.rand(5, 3, generator=g) + 0.1).to(torch.bfloat16)
    w = q * scale.float().repeat_interleave(128, dim=1)
    packed, s = quantize_int4(w)
    assert torch.equal(s, scale)
    assert torch.equal(dequantize_int4(packed, s, dtype=torch.float32), w)


def test_int4_shape_errors() -> None:
    with pytest.raises(ValueError, match="scale.*\\(2, 1\\)"):
        dequantize_int4(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.zeros(2, 100))


# ------------------------------------------------------------------------------- FP8


def test_fp8_blockwise_round_trip_and_partial_blocks() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(4))
    w[128:, 256:] = 0.0  # an all-zero (partial) block
    q, s = quantize_fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    # Each block's absmax maps to 448 exactly.
    assert s[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / 448, rel=1e-6)
    d = dequantize_fp8_blockwise(q, s, dtype=torch.float32)
    assert bool((d[128:, 256:] == 0).all())
    # e4m3: 3 mantissa bits -> relative step 2^-3 at most, half of it after rounding; values
    # far below the block max fall into subnormals, so bound by the block's scale as well.
    block_scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert bool(((d - w).abs() <= w.abs() / 16 + block_scale * 2.0**-9 + 1e-12).all())
    # Values already on the fp8 grid (times the block scale) survive exactly.
    assert torch.equal(dequantize_fp8_blockwise(*quantize_fp8_blockwise(d), dtype=torch.float32), d)


def test_fp8_act_groups_and_matmul_reference() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 256, generator=g)
    xq, xs = quantize_fp8_act(x)
    assert xq.shape == x.shape and xs.shape == (3, 5, 2)
    torch.testing.assert_close(xs[..., 1], x[..., 128:].abs().amax(-1) / 448)
    torch.testing.assert_close(dequantize_fp8_act(xq, xs), x, rtol=1 / 16, atol=xs.max().item())

    w = torch.randn(70, 256, generator=g) * 0.05
    wq, ws = quantize_fp8_blockwise(w)
    w_deq = dequantize_fp8_blockwise(wq, ws, dtype=torch.float32)
    # W8A16: exactly x @ dequant(W)^T.
    torch.testing.assert_close(fp8_blockwise_matmul_reference(x, wq, ws), x @ w_deq.T)
    # W8A8: both sides dequantised, bf16 out by default.
    y = fp8_blockwise_matmul_reference(xq, wq, ws, x_scale=xs)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 70)
    torch.testing.assert_close(y.float(), x @ w.T, rtol=0.1, atol=0.1)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_blockwise_matmul_reference(xq, wq, ws)


def test_fp8_shape_errors() -> None:
    q, _ = quantize_fp8_blockwise(torch.randn(130, 128))
    with pytest.raises(ValueError, match=r"scale.*\(2, 1\)"):
        dequantize_fp8_blockwise(q, torch.ones(1, 1))
    with pytest.raises(ValueError, match="group"):
        quantize_fp8_act(torch.randn(2, 100))


# --------------------------------------------------------------------- bytes / param


def test_bytes_per_param() -> None:
    assert bytes_per_param("bf16") == 2.0
    assert bytes_per_param("fp8") == 1.0
    assert bytes_per_param("mxfp4") == 0.53125
    assert bytes_per_param("int4_g128") == 0.515625
    assert bytes_per_param("nvfp4") == 0.5625
    assert bytes_per_param("int4") == 0.5
    with pytest.raises(ValueError, match="fmt.*int3"):
        bytes_per_param("int3")
