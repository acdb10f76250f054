"""Int4 projections of one input joined into one kernel call: each member's output equals its own
call and the dequantising reference; the joined model's logits equal the unjoined model's."""

from __future__ import annotations

import pytest
import torch

import deltamoe.model.load as load_module
from deltamoe.model.int4_projection_group import Int4ProjectionGroup, join_shared_input_projections
from deltamoe.model.load import load_model
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.ops.int4_experts import kernel_block_rows
from deltamoe.ops.int4_matmul import int4_matmul_reference
from deltamoe.ops.quant import quantize_int4
from deltamoe.quantize.checkpoint import quantize_checkpoint

pytestmark = pytest.mark.skipif(kernel_block_rows() is None, reason="no CPU int4 kernel with a known layout")


def _members(sizes: list[int], in_features: int, group: int, seed: int):
    """Loaded W4A16 Int4Linears of `sizes` output rows -> (the modules, their (packed, scale))."""
    gen = torch.Generator().manual_seed(seed)
    scheme = make_scheme("int4", group)
    mods, weights = [], []
    for n in sizes:
        packed, scale = quantize_int4(torch.randn(n, in_features, generator=gen), group)
        m = Int4Linear(in_features, n, scheme)
        m.load_weight(packed, scale)
        mods.append(m)
        weights.append((packed, scale))
    return mods, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_member_gets_its_own_output_and_the_reference(dtype):
    sizes, k, g = [96, 8, 64, 130], 256, 64
    mods, weights = _members(sizes, k, g, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    alone = [m(x) for m in mods]
    group = Int4ProjectionGroup(mods)
    for m in mods:
        m.group = group
    for m, own, (packed, scale) in zip(mods, alone, weights):
        got = m(x)
        assert got.shape == own.shape and got.dtype == dtype
        assert torch.equal(got, own)
        torch.testing.assert_close(got, int4_matmul_reference(x, packed, scale, g), rtol=2**-7, atol=1e-3)


def test_a_new_input_or_an_in_place_write_runs_the_joint_call_again():
    mods, weights = _members([64, 64], 128, 128, seed=3)
    group = Int4ProjectionGroup(mods)
    for m in mods:
        m.group = group
    a, b = mods
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(4))
    first = a(x).clone()
    x.mul_(2)  # an in-place write to the input the group last ran on
    torch.testing.assert_close(b(x), int4_matmul_reference(x, *weights[1], 128), rtol=2**-7, atol=1e-3)
    assert not torch.equal(a(x), first)  # a reads its columns of the joint call on the new x
    y = torch.randn(1, 128)
    torch.testing.assert_close(b(y), int4_matmul_reference(y, *weights[1], 128), rtol=2**-7, atol=1e-3)


def test_loaded_model_joins_the_shared_input_projections_and_its_logits_do_not_change(tmp_path, monkeypatch):
    path = tmp_path / "int4"
    quantize_checkpoint("tiny", path, make_scheme("int4", 32), dtype=torch.float32)
    joined = load_model(path)
    groups = {id(m.group) for m in joined.modules() if isinstance(m, Int4Linear) and m.group is not None}
    assert len(groups) > 0
    kda = next(m for m in joined.modules() if type(m).__name__ == "KimiDeltaAttention")
    assert kda.q_proj.group is kda.k_proj.group is kda.b_proj.group is not None
    assert kda.o_proj.group is None  # its input is the attention output
    moe = next(m for m in joined.modules() if type(m).__name__ == "MoE")
    shared = moe.shared_experts
    assert moe.routed_expert_down_proj.group is shared.gate_proj.group is shared.up_proj.group is not None
    monkeypatch.setattr(load_module, "join_shared_input_projections", lambda model: 0)
    plain = load_model(path)
    assert not any(isinstance(m, Int4Linear) and m.group is not None for m in plain.modules())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.inference_mode():
        assert torch.equal(joined(ids).logits, plain(ids).logits)
        assert torch.equal(joined(ids[:1, :1]).logits, plain(ids[:1, :1]).logits)
    assert join_shared_input_projections(plain) == len(groups)
