"""The fused KDA chunk kernel (`ops.kda_fused`, C++) against the readable recurrence and against
`chunk_kda`'s own torch path, on fresh random inputs: ragged lengths, groups whose chunks were
halved (huge decays), K != V, batches, an initial state, bf16 inputs, one thread; which calls it
takes (none that record a gradient, none in fp64), and its refusals of bad arguments.
(tests/ops/test_kda.py runs its whole chunk_kda suite on both paths as well.)"""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops import kda as kda_module
from deltamoe.ops import kda_fused
from deltamoe.ops.cpp_build import cpu_has_avx2
from deltamoe.ops.kda import chunk_kda, recurrent_kda
from tests.ops.test_kda import assert_rel_close, make_inputs

pytestmark = pytest.mark.skipif(not cpu_has_avx2(), reason="the kernel is built for AVX2 / AVX-512 CPUs")


def test_the_kernel_builds_and_is_on():
    """Setup installs the compiler and ninja: a build failure is a failure here, not a quiet fallback."""
    assert kda_fused._build() is None
    assert kda_fused.status() == "on"


def _both(x: dict[str, torch.Tensor], **kwargs) -> tuple[tuple, tuple]:
    kernel = chunk_kda(**x, output_final_state=True, **kwargs)
    with kda_fused.turned_off():
        torch_path = chunk_kda(**x, output_final_state=True, **kwargs)
    return kernel, torch_path


@pytest.mark.parametrize("b,t,h,dk,dv", [(1, 1, 1, 16, 16), (1, 63, 2, 16, 16), (2, 130, 3, 32, 24),
                                         (1, 257, 4, 64, 64), (2, 300, 2, 128, 128), (1, 77, 3, 48, 80)])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_the_recurrence_and_the_torch_path(b, t, h, dk, dv, gate, with_state):
    x = make_inputs(b, t, h, dk, dv, gate=gate, seed=b * 1000 + t + dk)
    state = torch.randn(b, h, dk, dv, generator=torch.Generator().manual_seed(t)) if with_state else None
    given = None if state is None else state.clone()
    (o, s), (o_torch, s_torch) = _both(x, initial_state=state, use_qk_l2norm=True)
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 2e-5)
    assert_rel_close(s, s_ref, 2e-5)
    assert_rel_close(o, o_torch, 2e-5)
    assert_rel_close(s, s_torch, 2e-5)
    if state is not None:
        assert torch.equal(state, given), "the caller's initial state must stay as it was"


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 32, 64, 128, 300])
def test_any_chunk_length(chunk_size):
    """(300 is past the kernel's MAX_CHUNK: that call keeps the torch path, same result.)"""
    x = make_inputs(1, 400, 2, 32, 32, seed=chunk_size)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 2e-5)
    assert_rel_close(s, s_ref, 2e-5)


def test_groups_with_halved_chunks(monkeypatch: pytest.MonkeyPatch):
    """Small groups, and decays so large in some of them that `_pick_chunk_size` halves their chunks:
    the kernel gets runs of different chunk lengths and must carry the state across all of them."""
    monkeypatch.setattr(kda_module, "GROUP_ELEMENTS", 2 * 32 * 32 * 16)
    x = make_inputs(1, 400, 2, 32, 32, gate="softplus", seed=7, a_log_range=(0.0, 0.5))
    x["g"][:, 100:180] *= 40.0  # spans of hundreds inside one group: its chunks shrink
    lengths = {kda_module._pick_chunk_size(x["g"][:, s : s + 32], 32) for s in range(0, 400, 32)}
    assert len(lengths) > 1, lengths
    (o, s), (o_torch, s_torch) = _both(x, use_qk_l2norm=True, chunk_size=32)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 2e-5)
    assert_rel_close(s, s_ref, 2e-5)
    assert_rel_close(o, o_torch, 2e-5)


def test_without_l2norm_and_with_a_scale():
    x = make_inputs(2, 90, 2, 32, 16, seed=3)
    x["q"], x["k"] = x["q"] / 6, x["k"] / 6  # a stable delta rule without the normalisation
    (o, s), (o_torch, _) = _both(x, use_qk_l2norm=False, scale=0.3)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=False, scale=0.3)
    assert_rel_close(o, o_ref, 2e-5)
    assert_rel_close(s, s_ref, 2e-5)
    assert_rel_close(o, o_torch, 2e-5)


def test_bf16_inputs_compute_in_fp32():
    x = make_inputs(1, 100, 2, 32, 32, seed=5, dtype=torch.bfloat16)
    (o, s), (o_torch, s_torch) = _both(x, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_rel_close(s, s_torch, 2e-5)
    assert_rel_close(o.float(), o_torch.float(), 1e-2)  # both round the same fp32 output to bf16


@pytest.mark.parametrize("threads", [1, 2])
def test_one_sequence_one_head_and_thread_counts(threads):
    """One (batch, head) pair (the whole call on one thread), several of one sequence or of one head."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, h in ((1, 1), (3, 1), (1, 5)):
            x = make_inputs(b, 150, h, 64, 64, seed=b * 10 + h)
            o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
            o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
            assert_rel_close(o, o_ref, 2e-5)
            assert_rel_close(s, s_ref, 2e-5)
    finally:
        torch.set_num_threads(saved)


def test_which_calls_take_the_kernel():
    x = make_inputs(1, 20, 1, 16, 16)
    assert kda_fused.usable(*x.values())
    with kda_fused.turned_off():
        assert not kda_fused.usable(*x.values())
    assert not kda_fused.usable(*(t.double() for t in x.values())), "fp64 (gradcheck) keeps the torch path"
    needs_grad = {**x, "q": x["q"].clone().requires_grad_()}
    assert not kda_fused.usable(*needs_grad.values())
    with torch.no_grad():
        assert kda_fused.usable(*needs_grad.values())


def test_under_autograd_the_torch_path_runs_and_agrees():
    x = make_inputs(1, 70, 2, 16, 16, seed=11)
    o_kernel, _ = chunk_kda(**x, use_qk_l2norm=True)
    q = x["q"].clone().requires_grad_()
    o_grad, _ = chunk_kda(**{**x, "q": q}, use_qk_l2norm=True)
    assert o_grad.requires_grad
    assert_rel_close(o_grad.detach(), o_kernel, 2e-5)
    o_grad.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_bad_arguments_are_refused_with_the_argument_named():
    x = {k: v.contiguous() for k, v in make_inputs(1, 40, 2, 16, 16).items()}
    state = torch.zeros(2, 16, 16)
    op = torch.ops.deltamoe_kda.chunk_forward
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(RuntimeError, match="segments"):
        op(*args, state, [0, 30, 16], 1.0, True, 1e-6)  # stops short of T
    with pytest.raises(RuntimeError, match="segments"):
        op(*args, state, [0, 40], 1.0, True, 1e-6)
    with pytest.raises(RuntimeError, match="state"):
        op(*args, torch.zeros(1, 16, 16), [0, 40, 16], 1.0, True, 1e-6)
    with pytest.raises(RuntimeError, match="fp32"):
        op(x["q"].double(), *args[1:], state, [0, 40, 16], 1.0, True, 1e-6)
