"""The expert-sorted forms as opaque ops (`ops.sorted_experts_op`): each equals the eager code it
wraps, its fake kernel agrees with the real one (`torch.library.opcheck`), and a graph traced in
full holds it as one call, with no graph break."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops import int4_experts as ie
from deltamoe.ops.int4_matmul import has_int4_cpu_kernel
from deltamoe.ops.moe import experts_forward, experts_forward_reference, route_tokens
from deltamoe.ops.packed_experts import experts_forward_by_expert
from deltamoe.ops.quant import dequantize_int4, quantize_int4
from deltamoe.ops.sorted_experts_op import int4_sorted_experts, sorted_experts

ACT = ("situ", 4.0, 25.0)


def _routing(rows: int, e: int, k: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen)
    weights, indices = route_tokens(torch.randn(rows, e, generator=gen), None, k)
    return x, weights, indices


def _traced_targets(fn, *args):
    """`fn(*args)` through dynamo in full (a graph break raises), the targets of its graph's calls."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=keep, fullgraph=True, dynamic=True)(*args)
    return out, [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]


def test_sorted_experts_op_is_experts_forward_and_one_call_in_a_graph():
    e, k, d, i = 16, 4, 32, 48
    gen = torch.Generator().manual_seed(3)
    w1, w3, w2 = (torch.randn(*s, generator=gen) * 0.2 for s in ((e, i, d), (e, i, d), (e, d, i)))
    x, weights, indices = _routing(12, e, k, d, seed=5)
    want = experts_forward(x, weights, indices, w1, w3, w2, act="situ")
    torch.testing.assert_close(want, experts_forward_reference(x, weights, indices, w1, w3, w2, act="situ"))
    args = (x, weights, indices, w1, w3, w2, *ACT)
    assert torch.equal(sorted_experts(*args), want)
    torch.library.opcheck(sorted_experts, args)
    got, targets = _traced_targets(lambda *a: sorted_experts(*a) * 2.0, *args)
    assert torch.equal(got, want * 2.0)
    assert targets.count(torch.ops.deltamoe.sorted_experts.default) == 1


def _int4_experts(e: int, d: int, i: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = {w: [quantize_int4(torch.randn(*shape, generator=gen) * 0.3, group) for _ in range(e)]
         for w, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i)))}
    ops = ie.ExpertOperands.stack([ie.gate_up_operand(q["w1"][j], q["w3"][j], group) for j in range(e)],
                                  [ie.down_operand(q["w2"][j], group) for j in range(e)], ie.kernel_block_rows())
    dense = [torch.stack([dequantize_int4(p, s, group, dtype=torch.float32) for p, s in q[w]])
             for w in ("w1", "w3", "w2")]
    return ops, dense


@pytest.mark.skipif(not has_int4_cpu_kernel(), reason="torch build lacks the CPU int4 kernel")
@pytest.mark.parametrize("e,k,d,i,group,rows", [(8, 2, 64, 96, 32, 9), (16, 4, 128, 128, 64, 20)])
def test_int4_sorted_experts_op_is_the_stacks_loop_and_one_call_in_a_graph(e, k, d, i, group, rows):
    ops, dense = _int4_experts(e, d, i, group, seed=e + rows)
    x, weights, indices = _routing(rows, e, k, d, seed=rows)
    want = experts_forward_by_expert(x, weights, indices, e,
                                     lambda j, r: ie.int4_expert_mlp(r, *ops.expert(j), i, d, group, *ACT))
    ref = experts_forward_reference(x.bfloat16().float(), weights, indices, *dense, act="situ")
    assert ((want - ref).abs().max() / ref.abs().max()).item() < 2**-7  # bf16 activations: a few 2^-9 steps
    args = (x, weights, indices, ops.w13, ops.sz13, ops.w2, ops.sz2, i, d, group, *ACT)
    got = int4_sorted_experts(*args)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    torch.library.opcheck(int4_sorted_experts, args)
    traced, targets = _traced_targets(lambda *a: int4_sorted_experts(*a) + 1.0, *args)
    assert torch.equal(traced, want + 1.0)
    assert targets.count(torch.ops.deltamoe.int4_sorted_experts.default) == 1

