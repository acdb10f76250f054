"""The one-row int4 kernel (`ops.int4_matvec`, C++) against its readable reference, the checkpoint's
dequantised weight and torch's own int4 kernel, on fresh random inputs: dense operands (rows padded
or not, every group size), expert stacks read through strides, both of the kernel's paths (AVX2
and plain C++), inside a compiled graph, and its refusals of bad operands."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops import int4_experts as ie
from deltamoe.ops import int4_matvec as mv
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel, int4_kernel_weight, int4_matmul
from deltamoe.ops.moe import route_tokens
from deltamoe.ops.quant import quantize_int4

pytestmark = pytest.mark.skipif(not has_int4_cpu_kernel() or not ie.kernel_layout_readable(),
                                reason="torch build lacks the CPU int4 kernel whose operand this reads")

VECTOR = [True, False] if mv.cpu_has_avx2() else [False]


def test_the_kernel_builds_and_is_on_where_the_cpu_has_avx2():
    """Setup installs the compiler and ninja: a build failure is a failure here, not a quiet fallback."""
    assert mv.build(), mv._build()
    if mv.cpu_has_avx2():
        assert mv.status() == "on" and mv.one_row_block() == ie.kernel_block_rows()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("vector", VECTOR)
@pytest.mark.parametrize("n,k,group,m", [(64, 128, 32, 1), (96, 256, 64, 1), (200, 512, 128, 1),
                                         (128, 512, 256, 3), (48, 64, 32, 2)])
def test_dense_matches_the_reference_and_torch_kernel(n, k, group, m, vector):
    """Rows 96, 200, 48 are no multiple of the operand's padding (64): padded rows are never written."""
    for trial in range(3):
        gen = torch.Generator().manual_seed(1000 * trial + n + k)
        packed, scale = quantize_int4(torch.randn(n, k, generator=gen), group)
        weight, sz = int4_kernel_weight(packed, scale, group, row_multiple=64)
        x = torch.randn(m, k, generator=gen).bfloat16()
        block = ie.kernel_block_rows()
        got = mv.matvec(x, weight, sz, n, block, group, vector=vector)
        assert got.shape == (m, n) and got.dtype == torch.float32
        ref = mv.matvec_reference(x, weight, sz, n, block, group)
        # fp32 sums in another order: a few fp32 ulps of the row's magnitude.
        assert _rel_err(got, ref) < 1e-5
        assert _rel_err(got, mv.dequantized_reference(x, packed, scale, group)) < 1e-5
        # torch's kernel rounds its output to bf16; ours, rounded the same way, agrees to that rounding.
        torch_out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, sz)[:, :n]
        assert _rel_err(got.bfloat16(), torch_out) < 2**-7


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_form", ["bf16", "fp32 of bf16 values", "fp32"])
def test_every_input_form_and_thread_count_matches_the_reference(x_form, threads):
    """bf16 x takes the bf16 dot-product path where the CPU has AVX512-BF16, fp32 x (holding bf16
    values or not) the fp32 one. A call of 64 blocks splits over the threads, whose chunks must
    read the calling thread's x and group sums."""
    assert mv.build()
    n, k, group = 4096, 1024, 128
    gen = torch.Generator().manual_seed(7)
    packed, scale = quantize_int4(torch.randn(n, k, generator=gen), group)
    weight, sz = int4_kernel_weight(packed, scale, group, row_multiple=64)
    x = torch.randn(1, k, generator=gen)
    x = {"bf16": x.bfloat16(), "fp32 of bf16 values": x.bfloat16().float(), "fp32": x}[x_form]
    block = ie.kernel_block_rows()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = mv.matvec(x, weight, sz, n, block, group)
    finally:
        torch.set_num_threads(saved)
    assert _rel_err(got, mv.matvec_reference(x, weight, sz, n, block, group)) < 1e-5


def _dense_operand(n: int, k: int, group: int, seed: int):
    """A random int4 weight as the model holds it (rows padded to 64) and one fp32 input row."""
    gen = torch.Generator().manual_seed(seed)
    packed, scale = quantize_int4(torch.randn(n, k, generator=gen), group)
    weight, sz = int4_kernel_weight(packed, scale, group, row_multiple=64)
    return weight, sz, torch.randn(1, k, generator=gen)


def test_int4_matmul_runs_the_kernel_at_one_row_and_torch_otherwise():
    n, k, group = 128, 256, 128
    weight, sz, x = _dense_operand(n, k, group, seed=3)
    on = int4_matmul(x, weight, sz, n, group)
    with mv.turned_off():
        off = int4_matmul(x, weight, sz, n, group)
    expected = mv.matvec(x.bfloat16(), weight, sz, n, mv.one_row_block(), group).bfloat16().float()
    assert torch.equal(on, expected)  # the kernel's output, rounded as the contract says
    assert _rel_err(on, off) < 2**-7
    two = int4_matmul(x.repeat(2, 1), weight, sz, n, group)  # two rows: torch's kernel
    with mv.turned_off():
        assert torch.equal(two, int4_matmul(x.repeat(2, 1), weight, sz, n, group))


def _stack(e: int, d: int, i: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = {w: [quantize_int4(torch.randn(*shape, generator=gen) * 0.3, group) for _ in range(e)]
         for w, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i)))}
    gate_up = [ie.gate_up_operand(q["w1"][j], q["w3"][j], group) for j in range(e)]
    down = [ie.down_operand(q["w2"][j], group) for j in range(e)]
    return ie.ExpertOperands.stack(gate_up, down, ie.kernel_block_rows()), gate_up, down


@pytest.mark.parametrize("vector", VECTOR)
@pytest.mark.parametrize("e,d,i,group", [(8, 64, 96, 32), (16, 128, 256, 128), (5, 96, 64, 32)])
def test_expert_stacks_read_in_place_match_each_experts_own_operand(e, d, i, group, vector):
    """Gate|up (one x shared by every selection) and down (each selection its own x, the stack
    block-major across experts) against each selected expert's own operand through the dense form."""
    ops, gate_up, down = _stack(e, d, i, group, seed=e + d)
    block = ie.kernel_block_rows()
    rows13, half_in = ops.w13.shape[1:]
    _, _, k_in, half_b = ops.w2.shape
    gen = torch.Generator().manual_seed(e)
    idx = torch.randint(0, e, (6,), generator=gen)
    x = torch.randn(1, d, generator=gen).bfloat16()
    got = mv.expert_matvec(x, ops.w13, ops.sz13, idx, 2 * i, block, group, (rows13 * half_in, half_in * block),
                           (2 * rows13, 2 * e * rows13, 2), vector=vector)
    want = torch.cat([mv.matvec_reference(x, *gate_up[j], 2 * i, block, group) for j in idx.tolist()])
    assert _rel_err(got, want) < 1e-5
    hidden = torch.randn(6, i, generator=gen).bfloat16()
    groups2, rows2 = ops.sz2.shape[1:3]
    got = mv.expert_matvec(hidden, ops.w2, ops.sz2, idx, d, block, group, (k_in * half_b, e * k_in * half_b),
                           (2 * groups2 * rows2, 2 * rows2, 2), vector=vector)
    want = torch.cat([mv.matvec_reference(hidden[r:r + 1], *down[j], d, block, group)
                      for r, j in enumerate(idx.tolist())])
    assert _rel_err(got, want) < 1e-5


@pytest.mark.parametrize("rows", [1, 3])
def test_routed_experts_by_the_kernel_match_the_other_forms(rows):
    """`int4_experts_by_matvec` (what one-token and in-place steps run with the kernel on) against
    torch's kernel on gathered operands and the in-place expressions, with the kernel turned off."""
    e, k, d, i, group = 16, 4, 128, 256, 128
    ops, _, _ = _stack(e, d, i, group, seed=rows)
    gen = torch.Generator().manual_seed(rows + 50)
    x = torch.randn(rows, d, generator=gen)
    weights, indices = route_tokens(torch.randn(rows, e, generator=gen), None, k)
    got = ie.int4_experts_by_matvec(x, weights, indices, ops, i, d, "situ")
    assert got.shape == (rows, d) and got.dtype == torch.float32
    with mv.turned_off():
        gathered = ie.int4_experts_static(x, weights, indices, ops, i, d, group, "situ", in_place=False)
        in_place = ie.int4_experts_in_place(x, weights, indices, ops, i, d, "situ")
    assert _rel_err(got, gathered) < 2**-7 and _rel_err(got, in_place) < 2**-7
    if rows == 1:
        assert torch.equal(ie.int4_experts_one_token(x, weights, indices, ops, i, d, group, "situ"), got)


def test_the_compiled_graph_calls_the_kernel_and_agrees_with_eager():
    n, k, group = 64, 256, 64
    weight, sz, x = _dense_operand(n, k, group, seed=9)

    def f(x):
        return torch.relu(int4_matmul(x * 2, weight, sz, n, group))

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    block = mv.one_row_block()  # (resolved before tracing, as int4 modules do when they load)
    # Inductor drops the fp32 -> bf16 -> fp32 round trip of the output (its rule for casts), so
    # the graph holds the kernel's fp32 output itself.
    unrounded = torch.relu(mv.matvec((x * 2).bfloat16(), weight, sz, n, block, group))
    got = compiled(x)
    assert torch.allclose(got, unrounded, rtol=1e-6, atol=1e-6) and _rel_err(got, f(x)) < 2**-7
    # Turned off, the graph traces again and runs torch's kernel (bf16 out, exactly as eager).
    with mv.turned_off():
        assert torch.equal(compiled(x), f(x))
    assert torch.allclose(compiled(x), unrounded, rtol=1e-6, atol=1e-6)  # and back


def test_bad_operands_are_refused_with_the_tensor_named():
    gen = torch.Generator().manual_seed(2)
    packed, scale = quantize_int4(torch.randn(64, 128, generator=gen), 32)
    weight, sz = int4_kernel_weight(packed, scale, 32, row_multiple=64)
    block, x = ie.kernel_block_rows(), torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="s: expected a contiguous bfloat16"):
        mv.matvec(x, weight, sz.float(), 64, block, 32)
    with pytest.raises(RuntimeError, match="w: too small"):
        mv.matvec(x, weight[: weight.shape[0] // 2], sz, 64, block, 32)
    with pytest.raises(RuntimeError, match="group: expected an even divisor"):
        mv.matvec(x, weight, sz, 64, block, 48)
    with pytest.raises(ValueError, match="x: expected 128 columns"):
        mv.matvec(torch.randn(1, 64), weight, sz, 64, block, 32)
    with pytest.raises(RuntimeError, match="experts: negative"):
        mv.expert_matvec(x, weight, sz, torch.tensor([-1]), 64, block, 32, (0, 64 * block), (0, 128, 2))
