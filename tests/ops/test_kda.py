"""KDA ops: chunked and decode forms against the token-by-token reference, and all three
against the external oracles (fla-core's naive KDA, transformers' torch KDA) — spec §4.2, §8."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamoe.ops import kda as kda_module
from deltamoe.ops import kda_fused
from deltamoe.ops.kda import chunk_kda, kda_step, kda_steps, l2_normalize, recurrent_kda
from deltamoe.ops.kda_gate import kda_gate

GATES = ("softplus", "lower_bound")


def make_inputs(
    b: int, t: int, h: int, dk: int, dv: int, gate: str = "lower_bound", seed: int = 0,
    a_log_range: tuple[float, float] = (0.0, 2.8), dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random q, k, v, beta; g from the real gate formula with random A_log, dt_bias and f."""
    gen = torch.Generator().manual_seed(seed)
    a_log = torch.empty(h).uniform_(*a_log_range, generator=gen)
    dt_bias = torch.randn(h * dk, generator=gen)
    f = torch.randn(b, t, h * dk, generator=gen)
    return {
        "q": torch.randn(b, t, h, dk, generator=gen, dtype=dtype),
        "k": torch.randn(b, t, h, dk, generator=gen, dtype=dtype),
        "v": torch.randn(b, t, h, dv, generator=gen, dtype=dtype),
        "g": kda_gate(f, a_log, dt_bias, h, kind=gate).to(dtype),
        "beta": torch.randn(b, t, h, generator=gen, dtype=dtype).sigmoid(),
    }


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """max |actual - expected| <= tol * max |expected| (one scale per tensor, as the spec's parity numbers)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all()
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"max abs err {err:.3g} vs {tol:g} * {scale:.3g}"


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def chunk_path(request: pytest.FixtureRequest):
    """Every test here runs twice: with `chunk_kda`'s fused kernel where a call may take it
    (ops/kda_fused.py: no gradient recorded, fp32, CPU) and with its torch path everywhere."""
    if request.param == "kernel":
        yield request.param
    else:
        with kda_fused.turned_off():
            yield request.param


@pytest.fixture(scope="module")
def fla_naive() -> ModuleType:
    """fla-core's naive KDA, loaded from its file: `import fla.ops.kda` needs triton (spec §8)."""
    fla = pytest.importorskip("fla")
    spec = importlib.util.spec_from_file_location("fla_kda_naive", Path(fla.__file__).parent / "ops/kda/naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_kda() -> ModuleType:
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def raw(fn):
    """transformers wraps these in a kernel-hub dispatcher; `__wrapped__` is the torch function."""
    return getattr(fn, "__wrapped__", fn)


# --- chunk_kda == recurrent_kda --------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 7, 63, 65, 130])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(t: int, gate: str, with_state: bool) -> None:
    x = make_inputs(2, t, 3, 12, 10, gate=gate, seed=t)
    state = torch.randn(2, 3, 12, 10, generator=torch.Generator().manual_seed(1)) if with_state else None
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)
    assert s.dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    x = make_inputs(1, 50, 2, 8, 6, seed=3)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_default_chunk_length_follows_the_head_size() -> None:
    """Without a chunk_size the chunk is as long as the head is wide, within [16, 64], and the
    result is the recurrence's."""
    assert [kda_module.default_chunk_size(k) for k in (8, 16, 32, 128)] == [16, 16, 32, 64]
    x = make_inputs(2, 37, 2, 32, 16, seed=4)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_chunk_survives_huge_decays() -> None:
    """A softplus gate with a_h up to e^6 (g down to ~ -1e3 per step) must not overflow: the
    factorized scores fall back to smaller blocks instead of computing exp of a large number."""
    x = make_inputs(1, 96, 2, 8, 8, gate="softplus", seed=5, a_log_range=(3.0, 6.0))
    x["g"][0, 40:44] = -1e4  # erase the memory outright for a few steps
    assert x["g"].min() < -1e3
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("group_elements", [1, 2000])
def test_groups_of_chunks_carry_the_state(monkeypatch: pytest.MonkeyPatch, group_elements: int) -> None:
    """chunk_kda walks the sequence in groups of chunks; with tiny groups (one chunk each, or a
    few), and a huge decay that shortens the chunks of one group only, the result is unchanged."""
    monkeypatch.setattr(kda_module, "GROUP_ELEMENTS", group_elements)
    x = make_inputs(2, 150, 2, 6, 5, seed=29)
    x["g"][:, 70:74] = -200.0
    state = torch.randn(2, 2, 6, 5)
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True, chunk_size=16)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_centering_matrix_gives_the_decay_from_the_chunk_middle() -> None:
    """(A g)_i = H_i - H_last / 2 with H_i = g_1 + ... + g_i: the exponents of the factorized scores."""
    g = -torch.rand(3, 8, 2, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    decay = F.pad(g[:, 1:].cumsum(1), (0, 0, 1, 0))  # H, g_0 left out
    expected = decay - decay[:, -1:] / 2
    assert (kda_module._centering_matrix(8, torch.float64) @ g - expected).abs().max() <= 1e-15


@pytest.mark.parametrize("gate", GATES)
def test_chunk_matches_recurrent_at_the_real_head_size(gate: str) -> None:
    """K = V = 128 (K3), chunks of 64 (softplus) and 32 (lower_bound: its decays halve them), a
    partial last chunk."""
    x = make_inputs(1, 150, 2, 128, 128, gate=gate, seed=37, a_log_range=(-4.0, -2.0))
    state = torch.randn(1, 2, 128, 128, generator=torch.Generator().manual_seed(38))
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_inference_and_autograd_state_passes_agree_and_leave_the_state_alone() -> None:
    """Without autograd the state pass writes into buffers and updates the state in place; with
    it every product is a new tensor. Both equal the recurrence at K = V = 128, and neither
    touches the initial state or the inputs it was given (the terms are scaled in place too)."""
    x = make_inputs(1, 100, 2, 128, 128, seed=53, a_log_range=(-4.0, -2.0))
    state = torch.randn(1, 2, 128, 128, generator=torch.Generator().manual_seed(54))
    given, given_inputs = state.clone(), {n: t.clone() for n, t in x.items()}
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    with torch.no_grad():
        o_in_place, s_in_place = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_autograd, s_autograd = chunk_kda(**leaves, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    assert o_autograd.grad_fn is not None
    for o, s in ((o_in_place, s_in_place), (o_autograd.detach(), s_autograd.detach())):
        assert_rel_close(o, o_ref, 1e-5)
        assert_rel_close(s, s_ref, 1e-5)
    assert torch.equal(state, given)
    assert all(torch.equal(x[n], given_inputs[n]) for n in x)


def test_gates_near_zero_over_a_long_sequence() -> None:
    """g within 1e-6 of 0 (the memory hardly fades) over 2,000 tokens in 32 chunks: the state
    keeps everything it was written, so an error in the carried decays would pile up."""
    x = make_inputs(1, 2000, 2, 16, 16, seed=43)
    x["g"] = -1e-6 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(44))
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_decays_past_fp32_range_between_chunks() -> None:
    """Every chunk's decay spans nearly MAX_CHUNK_SPAN (63 * 1.8 = 113): the factors e^(+-span/2)
    sit near their bounds, and any product of two neighbouring chunks' factors (e^-113 and less)
    leaves fp32's normal range, while the state and its weight e^-1.8 on the next chunk's first
    token do not (a form that folded the two into one factor failed here by 9 %)."""
    x = make_inputs(1, 256, 2, 8, 8, gate="softplus", seed=47)
    x["g"] = torch.full_like(x["g"], -1.8)
    assert kda_module._pick_chunk_size(x["g"], 64) == 64
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_padded_chunks_in_the_middle_of_the_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 5-token chunks whose decays halve them to 2: every group but the last ends in a
    padded chunk, whose padding must not reach the output or the state."""
    monkeypatch.setattr(kda_module, "GROUP_ELEMENTS", 1)  # one chunk_size run per group
    x = make_inputs(2, 23, 2, 6, 4, seed=41)
    x["g"][:, :, 0, 0] = -50.0  # a chunk of 5 spans 200 > MAX_CHUNK_SPAN, one of 2 spans 50
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=5)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


def test_no_decay_and_unit_beta_is_exact_delta_rule() -> None:
    """g = 0, beta = 1, one key repeated: the state must recall exactly the last value written."""
    k = l2_normalize(torch.randn(1, 1, 1, 4)).expand(1, 5, 1, 4)
    v = torch.randn(1, 5, 1, 3)
    o, s = chunk_kda(k, k, v, torch.zeros(1, 5, 1, 4), torch.ones(1, 5, 1), scale=1.0, output_final_state=True)
    # after writing v_t under key k, reading with q = k returns v_t (each write overwrites)
    torch.testing.assert_close(o, v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[0, 0], k[0, 0, 0, :, None] * v[0, -1, 0][None, :], rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_keep_an_fp32_state() -> None:
    x = make_inputs(1, 40, 2, 8, 8, seed=7)
    o_ref, s_ref = chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**{n: t.bfloat16() for n, t in x.items()}, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_rel_close(o.float(), o_ref, 3e-2)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_a_bf16_autocast_region_leaves_the_op_in_fp32(fn) -> None:
    """Inside the region the op's matmuls stay fp32 (the same values as outside it), and the
    triangular solve, which has no bf16 CPU kernel, runs; gradients come back in the inputs' dtype."""
    x = {n: t.bfloat16().requires_grad_() for n, t in make_inputs(1, 70, 2, 16, 8, seed=5).items()}
    state = torch.randn(1, 2, 16, 8)
    o_ref, s_ref = fn(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = fn(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    o.float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in x.values())


def test_gradients_match_recurrent() -> None:
    x = make_inputs(1, 37, 2, 6, 5, seed=11)
    state = torch.randn(1, 2, 6, 5)

    def grads(fn) -> list[torch.Tensor]:
        leaves = {n: t.clone().requires_grad_() for n, t in {**x, "initial_state": state}.items()}
        o, s = fn(**leaves, output_final_state=True, use_qk_l2norm=True)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
        ((o * weights).sum() + s.square().sum()).backward()
        return [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]

    for got, want in zip(grads(lambda **kw: chunk_kda(**kw, chunk_size=16)), grads(recurrent_kda)):
        assert_rel_close(got, want, 1e-4)


def test_gradients_stay_finite_near_the_largest_chunk_span() -> None:
    """Chunks whose decay spans nearly MAX_CHUNK_SPAN: the garbage above the diagonal of the
    factorized scores overflows to inf, and must reach no gradient (beta's included)."""
    x = make_inputs(1, 64, 2, 8, 8, gate="softplus", seed=5, a_log_range=(1.0, 2.0))
    x["g"] = x["g"].clamp(min=-3.5)
    assert kda_module._pick_chunk_size(x["g"], 64) == 32

    def grads(fn) -> list[torch.Tensor]:
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, s = fn(**leaves, output_final_state=True, use_qk_l2norm=True)
        (o.square().sum() + s.square().sum()).backward()
        return [leaves[n].grad for n in ("q", "k", "v", "g", "beta")]

    for got, want in zip(grads(chunk_kda), grads(recurrent_kda)):
        assert_rel_close(got, want, 1e-4)


def test_gradcheck_in_double() -> None:
    x = make_inputs(1, 9, 1, 3, 2, seed=13, dtype=torch.float64)
    inputs = tuple(x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta"))
    state = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, g, beta, s0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True, chunk_size=4)
        return o, s

    assert torch.autograd.gradcheck(fn, (*inputs, state), fast_mode=True)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2), t=st.integers(1, 40), h=st.integers(1, 3), dk=st.integers(1, 9), dv=st.integers(1, 9),
    chunk_size=st.integers(1, 20), gate=st.sampled_from(GATES), with_state=st.booleans(), seed=st.integers(0, 2**16),
)
def test_chunk_equals_recurrent_property(b, t, h, dk, dv, chunk_size, gate, with_state, seed) -> None:
    x = make_inputs(b, t, h, dk, dv, gate=gate, seed=seed)
    state = torch.randn(b, h, dk, dv, generator=torch.Generator().manual_seed(seed)) if with_state else None
    o_ref, s_ref = recurrent_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(**x, initial_state=state, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size)
    assert_rel_close(o, o_ref, 1e-5)
    assert_rel_close(s, s_ref, 1e-5)


# --- decode step -----------------------------------------------------------------------------


def test_decode_steps_equal_recurrent_and_leave_the_given_state_alone() -> None:
    n, h, dk, dv, steps = 3, 2, 8, 6, 4
    initial = torch.randn(n, h, dk, dv, generator=torch.Generator().manual_seed(16))
    x = make_inputs(n, steps, h, dk, dv, seed=17)  # batch axis = the N sequences

    outputs, state = [], initial.clone()
    for i in range(steps):
        step = {name: t[:, i] for name, t in x.items()}
        given = state.clone()
        o, state_next = kda_step(**step, state=state, use_qk_l2norm=True)
        assert torch.equal(state, given)  # the caller stores the new state, not the op
        outputs.append(o)
        state = state_next
    o_ref, s_ref = recurrent_kda(**x, initial_state=initial, output_final_state=True, use_qk_l2norm=True)

    torch.testing.assert_close(torch.stack(outputs, dim=1), o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, s_ref, rtol=1e-6, atol=1e-6)
    assert state.dtype == torch.float32 and outputs[0].dtype == x["v"].dtype


def test_steps_keep_the_recurrent_state_after_every_token() -> None:
    """The verification form: outputs as the reference's, and state j is the reference's final
    state after the first j + 1 tokens."""
    n, h, dk, dv, steps = 2, 2, 8, 6, 4
    initial = torch.randn(n, h, dk, dv, generator=torch.Generator().manual_seed(18))
    x = make_inputs(n, steps, h, dk, dv, seed=19)
    given = initial.clone()
    o, states = kda_steps(**x, state=initial, use_qk_l2norm=True)
    assert torch.equal(initial, given) and states.shape == (n, steps, h, dk, dv)
    o_ref, _ = recurrent_kda(**x, initial_state=initial, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    for j in range(steps):
        _, s_ref = recurrent_kda(**{name: t[:, :j + 1] for name, t in x.items()}, initial_state=initial,
                                 output_final_state=True, use_qk_l2norm=True)
        torch.testing.assert_close(states[:, j], s_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_bad_shapes_name_the_tensor(fn) -> None:
    x = make_inputs(1, 5, 2, 4, 3)
    with pytest.raises(ValueError, match=r"^g: expected shape \[B, T, H, K\]"):
        fn(**{**x, "g": x["g"][..., :3]})
    with pytest.raises(ValueError, match=r"^beta: expected shape \[B, T, H\]"):
        fn(**{**x, "beta": x["beta"][..., None]})
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[B, H, K, V\]"):
        fn(**x, initial_state=torch.zeros(1, 2, 3, 4))


# --- external oracles ------------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
def test_matches_fla_naive(fla_naive: ModuleType, gate: str) -> None:
    x = make_inputs(2, 80, 3, 16, 8, gate=gate, seed=19)
    q, k = l2_normalize(x["q"]), l2_normalize(x["k"])  # fla's naive has no l2norm inside
    state = torch.randn(2, 3, 16, 8)
    args = (q, k, x["v"], x["g"], x["beta"])
    o_rec, s_rec = fla_naive.naive_recurrent_kda(*args, initial_state=state, output_final_state=True)
    # its chunk form loops in Python over the chunk and needs T % chunk_size == 0: 5 chunks of 16
    o_chk, s_chk = fla_naive.naive_chunk_kda(*args, initial_state=state, output_final_state=True, chunk_size=16)
    for fn in (recurrent_kda, chunk_kda):
        o, s = fn(*args, initial_state=state, output_final_state=True)
        for o_want, s_want in ((o_rec, s_rec), (o_chk, s_chk)):
            assert_rel_close(o, o_want, 1e-5)
            assert_rel_close(s, s_want, 1e-5)


def test_matches_fla_naive_at_the_real_head_size_over_a_long_sequence(fla_naive: ModuleType) -> None:
    """K = V = 128, 1,024 tokens (16 chunks): chunk_kda against fla's naive chunk form, with gates
    near 0 in one head (little decay) and KimiLinear's softplus gate in the other."""
    x = make_inputs(1, 1024, 2, 128, 128, gate="softplus", seed=53, a_log_range=(-4.0, -2.0))
    x["g"][:, :, 0] = -1e-4 * torch.rand(1, 1024, 128, generator=torch.Generator().manual_seed(54))
    q, k = l2_normalize(x["q"]), l2_normalize(x["k"])
    state = torch.randn(1, 2, 128, 128, generator=torch.Generator().manual_seed(55))
    args = (q, k, x["v"], x["g"], x["beta"])
    o_want, s_want = fla_naive.naive_chunk_kda(*args, initial_state=state, output_final_state=True, chunk_size=64)
    o, s = chunk_kda(*args, initial_state=state, output_final_state=True)
    assert_rel_close(o, o_want, 1e-5)
    assert_rel_close(s, s_want, 1e-5)


@pytest.mark.parametrize("t", [64, 77])
def test_matches_transformers_torch_kda(hf_kda: ModuleType, t: int) -> None:
    x = make_inputs(2, t, 3, 16, 16, gate="softplus", seed=23)
    state = torch.randn(2, 3, 16, 16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o_hf_chunk, s_hf_chunk = raw(hf_kda.chunk_kimi_delta_attention)(
        *args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_hf_rec, s_hf_rec = raw(hf_kda.recurrent_kimi_delta_attention)(*args, state, True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(*args, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    for o_want, s_want in ((o_hf_chunk, s_hf_chunk), (o_hf_rec, s_hf_rec)):
        assert_rel_close(o, o_want, 1e-5)
        assert_rel_close(s, s_want, 1e-5)


def reference_chunk_pick(g: torch.Tensor, chunk_size: int) -> int:
    """`_pick_chunk_size` by its definition: halve C until every chunk of C tokens (the last one
    shorter) has span -(g_1 + ... + g_{C-1}) <= MAX_CHUNK_SPAN in every (batch, head, channel)."""
    chunk = min(chunk_size, g.shape[1])
    while chunk > 1:
        spans = [-g[:, start + 1 : start + chunk].sum(1) for start in range(0, g.shape[1], chunk)]
        if max(s.max().item() for s in spans) <= kda_module.MAX_CHUNK_SPAN:
            return chunk
        chunk //= 2
    return 1


@pytest.mark.parametrize("seed", range(6))
def test_chunk_pick_matches_its_definition(seed: int) -> None:
    """The one-pass pick (a chunk and both its halves per matmul) against the per-chunk loop, on
    fresh random log-decays from tiny to huge, odd and even chunk sizes, padded tails."""
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(40):
        b, t, h, dk = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 3), (1, 200), (1, 3), (1, 6)))
        g = -torch.rand(b, t, h, dk, generator=gen) ** 3 * float(torch.rand(1, generator=gen)) * 40
        g[:, int(torch.randint(0, t, (1,), generator=gen))] *= 50  # one token's decay may need short chunks
        chunk_size = int(torch.randint(1, 80, (1,), generator=gen))
        assert kda_module._pick_chunk_size(g, chunk_size) == reference_chunk_pick(g, chunk_size), (g.shape, chunk_size)
