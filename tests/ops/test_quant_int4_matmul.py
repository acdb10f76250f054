"""The CPU int4 matmuls (W4A16, W4A8 int8 / fp8) against their dequantising references."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.int4_matmul import (
    dequantized_matmul,
    fp8_act_per_row,
    has_int4_cpu_kernel,
    has_w4a8_int8_kernel,
    int4_kernel_weight,
    int4_matmul,
    int4_matmul_reference,
    w4a8_fp8_matmul,
    w4a8_fp8_matmul_reference,
    w4a8_int8_matmul,
    w4a8_int8_matmul_reference,
    w4a8_int8_weight,
)
from deltamoe.ops.quant import quantize_int4

needs_int4 = pytest.mark.skipif(not has_int4_cpu_kernel(), reason="torch build lacks the CPU int4 kernel")
SHAPES = [(1, 7, 128, 128), (3, 100, 384, 128), (5, 65, 256, 64), (2, 33, 96, 32)]  # (M, N, K, group)


def _weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(n, k, generator=gen), group)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@needs_int4
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_int4_matmul_matches_reference(m, n, k, group):
    packed, scale = _weights(n, k, group, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    weight, sz = int4_kernel_weight(packed, scale, group)
    y = int4_matmul(x, weight, sz, n, group)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # Same contract (bf16 in, fp32 accumulation, bf16 out): only the summation order differs,
    # which can move a bf16 rounding by one step.
    ref = int4_matmul_reference(x, packed, scale, group)
    assert _rel_err(y, ref) < 2**-8
    assert (y != ref).float().mean() < 0.1
    assert _rel_err(int4_matmul(x.bfloat16(), weight, sz, n, group), ref) < 2**-8
    exact = dequantized_matmul(x, packed, scale, group)  # and bf16 activations cost about 2^-9
    assert 1e-5 < _rel_err(y, exact) < 2**-6


@needs_int4
def test_int4_matmul_keeps_leading_dims():
    packed, scale = _weights(48, 256, 128, seed=1)
    weight, sz = int4_kernel_weight(packed, scale)
    x = torch.randn(2, 3, 256)
    assert torch.equal(int4_matmul(x, weight, sz, 48), int4_matmul(x.reshape(6, 256), weight, sz, 48).reshape(2, 3, 48))


def test_int4_kernel_rejects_unsupported_group():
    packed, scale = _weights(8, 96, 48, seed=0)
    with pytest.raises(ValueError, match="group_size"):
        int4_kernel_weight(packed, scale, 48)


@pytest.mark.skipif(not has_w4a8_int8_kernel(), reason="torch build lacks _dyn_quant_matmul_4bit")
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_w4a8_int8_matches_reference(m, n, k, group):
    packed, scale = _weights(n, k, group, seed=n + 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    weight = w4a8_int8_weight(packed, scale, group)
    y = w4a8_int8_matmul(x, weight, k, n, group)
    ref = w4a8_int8_matmul_reference(x, packed, scale, group)
    assert _rel_err(y, ref) < 1e-5  # same int8 activations: only the summation order differs
    full = dequantized_matmul(x, packed, scale, group)
    assert 1e-4 < _rel_err(y, full) < 0.05  # and the int8 rounding is really there


@needs_int4
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_w4a8_fp8_matches_reference(m, n, k, group):
    packed, scale = _weights(n, k, group, seed=n + 2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    weight, sz = int4_kernel_weight(packed, scale, group)
    y = w4a8_fp8_matmul(x, weight, sz, n, group)
    ref = w4a8_fp8_matmul_reference(x, packed, scale, group)
    assert _rel_err(y, ref) < 2**-8  # e4m3 is exact in bf16: only the summation order differs
    full = dequantized_matmul(x, packed, scale, group)
    assert 1e-3 < _rel_err(y, full) < 0.1


def test_fp8_act_rows_hit_e4m3_max():
    x = torch.randn(4, 64) * torch.tensor([[1e-3], [1.0], [50.0], [3.0]])
    q, s = fp8_act_per_row(x)
    assert torch.equal(q.abs().amax(-1), torch.full((4,), 448.0))
    assert _rel_err(q * s, x) < 0.07  # e4m3 keeps 3 mantissa bits
