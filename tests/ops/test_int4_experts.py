"""Stacked int4 experts (two kernel calls per expert, two per one-token step) against the dense
reference on the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops import int4_experts as ie
from deltamoe.ops import int4_matvec
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel
from deltamoe.ops.moe import experts_forward_reference, route_tokens
from deltamoe.ops.packed_experts import experts_forward_by_expert
from deltamoe.ops.quant import dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(not has_int4_cpu_kernel(), reason="torch build lacks the CPU int4 kernel")


@pytest.fixture(autouse=True, params=["one-row kernel", "torch kernel"])
def one_row_form(request):
    """Every test runs twice: one-row steps through our kernel (`ops.int4_matvec`, where it is
    built), and through torch's kernel and the in-place expressions (as without it)."""
    if request.param == "one-row kernel":
        if not int4_matvec.one_row_block():
            pytest.skip(f"one-row int4 kernel: {int4_matvec.status()}")
        yield
    else:
        with int4_matvec.turned_off():
            yield


def _operands(e: int, d: int, i: int, group: int, seed: int):
    """Random quantized experts -> (per-expert gate|up operands, down operands, the quantized weights)."""
    gen = torch.Generator().manual_seed(seed)
    q = {w: [quantize_int4(torch.randn(*shape, generator=gen) * 0.3, group) for _ in range(e)]
         for w, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i)))}
    gate_up = [ie.gate_up_operand(q["w1"][j], q["w3"][j], group) for j in range(e)]
    down = [ie.down_operand(q["w2"][j], group) for j in range(e)]
    return gate_up, down, q


def _experts(e: int, d: int, i: int, group: int, seed: int):
    """Random quantized experts -> (stacked kernel operands `ExpertOperands`, dequantised fp32 w1, w3, w2)."""
    gate_up, down, q = _operands(e, d, i, group, seed)
    ops = ie.ExpertOperands.stack(gate_up, down, ie.kernel_block_rows())
    dense = [torch.stack([dequantize_int4(p, s, group, dtype=torch.float32) for p, s in q[w]])
             for w in ("w1", "w3", "w2")]
    return ops, dense


def _reference(x, weights, indices, dense, act):
    """The int4 contract written out: bf16 activations into each matmul, fp32 weighted sum."""
    w1, w3, w2 = dense
    return experts_forward_reference(x.bfloat16().float(), weights, indices, w1, w3, w2, act=act)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_the_probe_finds_the_block_layout_this_build_uses():
    assert ie.kernel_block_rows() in (64, 32, 16)


@pytest.mark.parametrize("block_rows", [ie.kernel_block_rows(), None])
def test_stacked_operands_give_each_expert_back_unchanged(block_rows):
    """The gather-ordered stack returns each expert's operands exactly as converted."""
    e, d, i, group = 5, 96, 64, 32
    gate_up, down, _ = _operands(e, d, i, group, seed=4)
    ops = ie.ExpertOperands.stack(gate_up, down, block_rows)
    for j in range(e):
        for got, want in zip(ops.expert(j), (*gate_up[j], *down[j])):
            assert got.is_contiguous() and torch.equal(got, want)


# (e, k, d, i, group, act): small and odd shapes; d = 96 pads the down operand's rows to 128.
SHAPES = [(8, 2, 64, 96, 32, "situ"), (16, 4, 128, 256, 128, "silu"), (5, 3, 96, 64, 32, "situ"),
          (32, 8, 256, 256, 128, "situ")]


@pytest.mark.parametrize("e,k,d,i,group,act", SHAPES)
def test_one_token_step_matches_the_reference(e, k, d, i, group, act):
    ops, dense = _experts(e, d, i, group, seed=e + d)
    for trial in range(3):  # fresh inputs and routings
        gen = torch.Generator().manual_seed(100 * trial + e)
        x = torch.randn(1, d, generator=gen)
        weights, indices = route_tokens(torch.randn(1, e, generator=gen), None, k)
        got = ie.int4_experts_one_token(x, weights, indices, ops, i, d, group, act)
        ref = _reference(x, weights, indices, dense, act)
        assert got.shape == (1, d) and got.dtype == torch.float32
        # bf16 rounding of the hidden rows and of the summed output: a few 2^-9 steps.
        assert _rel_err(got, ref) < 2**-7
        by_expert = experts_forward_by_expert(
            x.bfloat16(), weights, indices, e,
            lambda j, rows: ie.int4_expert_mlp(rows, *ops.expert(j), i, d, group, act))
        assert _rel_err(got, by_expert) < 2**-7


@pytest.mark.parametrize("e,k,d,i,group,act", SHAPES[:3])
def test_expert_by_expert_matches_the_reference(e, k, d, i, group, act):
    ops, dense = _experts(e, d, i, group, seed=e)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, d, generator=gen)
    weights, indices = route_tokens(torch.randn(11, e, generator=gen), None, k)
    used = set()

    def mlp(j, rows):
        used.add(j)
        return ie.int4_expert_mlp(rows, *ops.expert(j), i, d, group, act)

    got = experts_forward_by_expert(x, weights, indices, e, mlp)
    assert _rel_err(got, _reference(x, weights, indices, dense, act)) < 2**-7
    assert used == set(indices.flatten().tolist())


def test_one_token_step_reads_only_the_selected_experts():
    """Experts outside the top-k hold garbage (NaN scales): the step must not see them."""
    e, k, d, i, group = 8, 2, 64, 96, 32
    ops, dense = _experts(e, d, i, group, seed=3)
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
    weights, indices = torch.tensor([[0.7, 0.3]]), torch.tensor([[5, 2]])
    unused = [j for j in range(e) if j not in (5, 2)]
    sz13, sz2 = ops.sz13.clone(), ops.sz2.clone()
    sz13[:, unused], sz2[unused] = float("nan"), float("nan")
    ops = ie.ExpertOperands(ops.w13, sz13, ops.w2, sz2)
    got = ie.int4_experts_one_token(x, weights, indices, ops, i, d, group, "situ")
    assert torch.isfinite(got).all()
    assert _rel_err(got, _reference(x, weights, indices, dense, "situ")) < 2**-7


@pytest.mark.parametrize("e,k,d,i,group,act", SHAPES[:3])
@pytest.mark.parametrize("rows", [1, 2, 3, 12])
@pytest.mark.parametrize("in_place", [True, False])
def test_static_form_matches_the_reference_in_both_forms(e, k, d, i, group, act, rows, in_place):
    """Few rows read their experts in place or gather them, many run every expert
    (`gathers_expert_weights`); every form against the reference and the one-token step, repeated
    rows included (compiled decode runs a batch of one as two copies of its row)."""
    ops, dense = _experts(e, d, i, group, seed=e + rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, d, generator=gen)
    weights, indices = route_tokens(torch.randn(rows, e, generator=gen), None, k)
    got = ie.int4_experts_static(x, weights, indices, ops, i, d, group, act, in_place=in_place)
    assert got.shape == (rows, d) and got.dtype == torch.float32
    assert _rel_err(got, _reference(x, weights, indices, dense, act)) < 2**-7
    one = ie.int4_experts_one_token(x[:1], weights[:1], indices[:1], ops, i, d, group, act)
    twice = ie.int4_experts_static(x[:1].repeat(2, 1), weights[:1].repeat(2, 1), indices[:1].repeat(2, 1), ops, i, d,
                                   group, act, in_place=in_place)
    assert torch.equal(twice[0], twice[1]) and _rel_err(twice[:1], one) < 2**-7


def test_kernel_codes_read_the_converted_operand_back():
    """The layout the in-place form reads, written out, against torch's own converter (two blocks)."""
    rows = ie.kernel_block_rows()
    assert ie.kernel_layout_readable()
    codes = torch.randint(0, 16, (2 * rows, 96), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    assert torch.equal(ie.kernel_codes(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), rows), codes)


@pytest.mark.parametrize("e,k,d,i,group,act", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_in_place_form_matches_the_reference_and_the_kernel_forms(e, k, d, i, group, act, rows):
    """Fresh inputs and routings; padded operand rows (d = 96, 2i = 192) included. Experts outside
    the selection hold NaN scales: the in-place form reads only the selected experts."""
    ops, dense = _experts(e, d, i, group, seed=3 * e + rows)
    gen = torch.Generator().manual_seed(11 * rows + e)
    x = torch.randn(rows, d, generator=gen)
    weights, indices = route_tokens(torch.randn(rows, e, generator=gen), None, k)
    unused = [j for j in range(e) if j not in set(indices.flatten().tolist())]
    sz13, sz2 = ops.sz13.clone(), ops.sz2.clone()
    sz13[:, unused], sz2[unused] = float("nan"), float("nan")
    got = ie.int4_experts_in_place(x, weights, indices, ie.ExpertOperands(ops.w13, sz13, ops.w2, sz2), i, d, act)
    assert got.shape == (rows, d) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert _rel_err(got, _reference(x, weights, indices, dense, act)) < 2**-7
    gathered = ie.int4_experts_static(x, weights, indices, ops, i, d, group, act, in_place=False)
    assert _rel_err(got, gathered) < 2**-7
    if rows == 1:
        assert _rel_err(got, ie.int4_experts_one_token(x, weights, indices, ops, i, d, group, act)) < 2**-7
