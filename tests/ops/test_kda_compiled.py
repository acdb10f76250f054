"""The compiled chunked KDA (ops/kda_compiled.py) against the token-by-token reference, the eager
`chunk_kda` and fla's naive chunk form at K3's head size."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch._dynamo.utils import counters

from deltamoe.ops.kda import chunk_kda, l2_normalize, recurrent_kda
from deltamoe.ops.kda_compiled import compiled_chunk_kda
from deltamoe.serve.engine.compiled_decode import compiler_available

from tests.ops.test_kda import assert_rel_close, fla_naive, make_inputs  # noqa: F401 (fla_naive: a fixture)


pytestmark = pytest.mark.skipif(not compiler_available(), reason="torch.compile's CPU kernels need a C++ compiler")


def test_outputs_equal_the_reference_for_any_token_count() -> None:
    """Odd sizes, a state coming in, l2 norm inside; groups of two chunks of 16, so T = 70 is two
    compiled groups and an eager tail of 6 tokens, T = 45 one group and a tail of 13, and both run
    the one graph. (The lower-bound gate keeps chunks of 16: a shorter chunk would be a graph
    class of its own.)"""
    state = torch.randn(2, 3, 16, 8)
    graphs = None
    for t, seed in ((70, 31), (45, 32)):
        x = make_inputs(2, t, 3, 16, 8, gate="lower_bound", seed=seed)
        with torch.no_grad():
            o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
            o_eager, s_eager = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                         chunk_size=16)
            o, s = compiled_chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                      chunk_size=16, group_chunks=2)
        for got, want in ((o, o_ref), (s, s_ref), (o, o_eager), (s, s_eager)):
            assert_rel_close(got, want, 1e-5)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # the tail runs eagerly: no second compile


def test_rejects_an_empty_group() -> None:
    x = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="group_chunks"):
        compiled_chunk_kda(**x, group_chunks=0)


@pytest.mark.slow  # compiles a forward and a backward graph: tens of seconds
def test_gradients_equal_the_eager_op() -> None:
    x = make_inputs(2, 70, 3, 16, 8, gate="softplus", seed=33)
    state = torch.randn(2, 3, 16, 8)
    results = []
    for fn in (chunk_kda, compiled_chunk_kda):
        leaves = {n: v.clone().requires_grad_() for n, v in x.items()}
        o, s = fn(**leaves, initial_state=state, output_final_state=True, use_qk_l2norm=True, chunk_size=16,
                  **({"group_chunks": 2} if fn is compiled_chunk_kda else {}))
        (o.square().sum() + s.square().sum()).backward()
        results.append([leaves[n].grad for n in x])
    for grad, want in zip(results[1], results[0]):
        assert_rel_close(grad, want, 1e-4)


@pytest.mark.slow  # a second graph class (K = 128)
def test_matches_fla_naive_at_the_real_head_size(fla_naive: ModuleType) -> None:  # noqa: F811
    """K = V = 128 (K3), KimiLinear's softplus gate, two chunks of 64 (two compiled calls of one
    chunk each) and a state coming in."""
    x = make_inputs(1, 128, 1, 128, 128, gate="softplus", seed=57, a_log_range=(-4.0, -2.0))
    q, k = l2_normalize(x["q"]), l2_normalize(x["k"])
    state = torch.randn(1, 1, 128, 128, generator=torch.Generator().manual_seed(58))
    args = (q, k, x["v"], x["g"], x["beta"])
    o_want, s_want = fla_naive.naive_chunk_kda(*args, initial_state=state, output_final_state=True, chunk_size=64)
    with torch.no_grad():
        o, s = compiled_chunk_kda(*args, initial_state=state, output_final_state=True, group_chunks=1)
    assert_rel_close(o, o_want, 1e-5)
    assert_rel_close(s, s_want, 1e-5)
