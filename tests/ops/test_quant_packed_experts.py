"""Experts run one packed expert at a time, against the dense reference on dequantised weights."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.moe import experts_forward_reference, route_tokens
from deltamoe.ops.packed_experts import experts_forward_by_expert
from deltamoe.ops.activations import glu
from deltamoe.ops.quant import dequantize_mxfp4, dequantize_mxfp4_bf16, quantize_mxfp4


def _mxfp4_stack(e: int, rows: int, cols: int, gen: torch.Generator):
    parts = [quantize_mxfp4(torch.randn(rows, cols, generator=gen) * 0.2) for _ in range(e)]
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


@pytest.mark.parametrize("n,e,k,d,i", [(1, 5, 2, 64, 96), (13, 7, 3, 96, 32), (40, 9, 4, 32, 160)])
def test_packed_mxfp4_experts_match_the_dense_reference(n, e, k, d, i):
    gen = torch.Generator().manual_seed(n)
    packed = {w: _mxfp4_stack(e, *shape, gen) for w, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i)))}
    x = torch.randn(n, d, generator=gen)
    weights, indices = route_tokens(torch.randn(n, e, generator=gen), None, k)
    used = set()

    def expert_mlp(expert, rows):
        used.add(expert)
        w1, w3, w2 = (dequantize_mxfp4(packed[w][0][expert], packed[w][1][expert], torch.float32)
                      for w in ("w1", "w3", "w2"))
        return glu(rows @ w1.T, rows @ w3.T, "situ", 4.0, 25.0) @ w2.T

    got = experts_forward_by_expert(x, weights, indices, e, expert_mlp)
    dense = {w: torch.stack([dequantize_mxfp4(p[j], s[j], torch.float32) for j in range(e)])
             for w, (p, s) in packed.items()}
    ref = experts_forward_reference(x, weights, indices, dense["w1"], dense["w3"], dense["w2"], act="situ")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert used == set(indices.flatten().tolist())  # only routed experts are unpacked


def test_no_tokens_gives_zeros_without_calling_experts():
    out = experts_forward_by_expert(torch.zeros(0, 8), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), 4,
                                    lambda e, x: pytest.fail("expert called"))
    assert out.shape == (0, 8)


def test_mismatched_routing_is_rejected():
    with pytest.raises(ValueError, match="weights and indices"):
        experts_forward_by_expert(torch.zeros(3, 8), torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.long), 4,
                                  lambda e, x: x)


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (64, 256)])
def test_bf16_table_dequant_equals_the_reference_bit_for_bit(rows, cols):
    gen = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 255, (rows, cols // 32), generator=gen, dtype=torch.uint8)  # every E8M0 but NaN
    got = dequantize_mxfp4_bf16(packed, scale)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_mxfp4(packed, scale, torch.bfloat16))
    assert torch.equal(got.float(), dequantize_mxfp4(packed, scale, torch.float32))  # bf16 holds them exactly
