"""KDA decay gates and the short causal conv against transformers (spec §4.2, §8):
Glm5NextTextForgetGate (K3 lower-bound gate), KimiLinearForgetGate (softplus gate), and the
torch fallbacks `causal_conv1d_fn` / `causal_conv1d_update` of KimiLinear."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from deltamoe.ops.kda_gate import causal_conv1d, kda_gate

HIDDEN, HEADS, HEAD_DIM = 20, 3, 6


@pytest.fixture(scope="module")
def hf_kimi() -> ModuleType:
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def randomize(module: torch.nn.Module, seed: int) -> None:
    """The gates' A_log and dt_bias are torch.empty until _init_weights; give every parameter values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def gate_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 3


def test_lower_bound_gate_matches_glm5_next() -> None:
    glm5 = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(hidden_size=HIDDEN, linear_head_dim=HEAD_DIM, linear_num_heads=HEADS, num_hidden_layers=2)
    assert cfg.linear_lower_bound == -5.0
    gate = glm5.Glm5NextTextForgetGate(cfg)
    randomize(gate, seed=1)
    x = gate_input()
    with torch.no_grad():
        want = gate(x)
        got = kda_gate(gate.f_b_proj(gate.f_a_proj(x)), gate.A_log, gate.dt_bias, HEADS, kind="lower_bound")
    assert got.shape == (2, 9, HEADS, HEAD_DIM) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got <= 0).all() and (got >= -5).all()  # (-5, 0) up to sigmoid saturating in fp32


def test_softplus_gate_matches_kimi_linear(hf_kimi: ModuleType) -> None:
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=2,
        linear_attn_config={"head_dim": HEAD_DIM, "num_heads": HEADS, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": [2]},
    )
    gate = hf_kimi.KimiLinearForgetGate(cfg)
    randomize(gate, seed=2)
    assert gate.A_log.shape == (1, 1, HEADS, 1)
    x = gate_input(seed=3) * 4  # pushes f + dt_bias past the softplus cut-off at 20 too
    with torch.no_grad():
        want = gate(x)
        f = gate.f_b_proj(gate.f_a_proj(x))
        got = kda_gate(f, gate.A_log, gate.dt_bias, HEADS, kind="softplus")
    assert ((f + gate.dt_bias) > 20).any()
    # transformers uses log(1 + exp(z)), torch softplus log1p(exp(z)): equal up to fp32 rounding
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got <= 0).all()


def test_gate_formulas_by_hand() -> None:
    f = torch.tensor([[[0.5, -1.0, 2.0, 0.0]]])  # B=1, T=1, H=2, K=2
    a_log = torch.tensor([0.0, 0.693147])  # a = 1, 2
    dt_bias = torch.tensor([0.0, 0.5, -2.0, 1.0])
    z = torch.tensor([[0.5, -0.5], [0.0, 1.0]])
    a = torch.tensor([[1.0], [2.0]])
    softplus = kda_gate(f, a_log, dt_bias, 2, kind="softplus")[0, 0]
    torch.testing.assert_close(softplus, -a * torch.log1p(torch.exp(z)), rtol=1e-5, atol=1e-6)
    bounded = kda_gate(f, a_log, dt_bias, 2, kind="lower_bound", lower_bound=-3.0)[0, 0]
    torch.testing.assert_close(bounded, -3.0 / (1 + torch.exp(-a * z)), rtol=1e-5, atol=1e-6)


def test_gate_rejects_bad_arguments() -> None:
    f, a_log, dt_bias = torch.zeros(1, 2, 12), torch.zeros(3), torch.zeros(12)
    with pytest.raises(ValueError, match="^kind"):
        kda_gate(f, a_log, dt_bias, 3, kind="sigmoid")
    with pytest.raises(ValueError, match="^f: expected shape"):
        kda_gate(f, a_log, dt_bias, 5, kind="softplus")
    with pytest.raises(ValueError, match="^A_log"):
        kda_gate(f, torch.zeros(4), dt_bias, 3, kind="softplus")
    with pytest.raises(ValueError, match="^dt_bias"):
        kda_gate(f, a_log, torch.zeros(4), 3, kind="lower_bound")


# --- causal conv -----------------------------------------------------------------------------


def conv_inputs(t: int, channels: int = 5, width: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, t, channels, generator=gen), torch.randn(channels, width, generator=gen)


def conv_by_hand(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """y_t = silu(sum_w weight[c, w] * x_{t-(W-1)+w}), reading before t = 0 from the state."""
    seq = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
    width = weight.shape[-1]
    y = torch.stack([(seq[:, t : t + width] * weight.T).sum(1) for t in range(x.shape[1])], dim=1)
    return torch.nn.functional.silu(y)


@pytest.mark.parametrize("t", [1, 2, 3, 11, 24, 70])
def test_conv_matches_a_plain_loop(t: int) -> None:
    x, weight = conv_inputs(t)
    state = torch.randn(2, 5, 3)
    y, new_state = causal_conv1d(x, weight, state)
    torch.testing.assert_close(y, conv_by_hand(x, weight, state), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, torch.cat([state, x.transpose(1, 2)], dim=-1)[..., -3:])


def test_conv_prefill_matches_transformers(hf_kimi: ModuleType) -> None:
    x, weight = conv_inputs(13)
    want = getattr(hf_kimi.causal_conv1d_fn, "__wrapped__", hf_kimi.causal_conv1d_fn)
    for activation in ("silu", None):
        y, state = causal_conv1d(x, weight.unsqueeze(1), activation=activation)  # nn.Conv1d layout [C, 1, W]
        torch.testing.assert_close(y, want(x.transpose(1, 2), weight, activation=activation).transpose(1, 2))
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("t", [1, 2])
def test_conv_decode_matches_transformers_update(hf_kimi: ModuleType, t: int) -> None:
    update = getattr(hf_kimi.causal_conv1d_update, "__wrapped__", hf_kimi.causal_conv1d_update)
    x, weight = conv_inputs(t, seed=4)
    state = torch.randn(2, 5, 3)
    hf_state = state.clone()  # transformers updates its conv_state in place
    want = update(x.transpose(1, 2), hf_state, weight, activation="silu").transpose(1, 2)
    y, new_state = causal_conv1d(x, weight, state)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(new_state, hf_state)


@pytest.mark.parametrize("split", [1, 2, 5, 8])
def test_conv_in_pieces_equals_one_pass(split: int) -> None:
    """Chunked prefill / decode: the state carries exactly what the next piece needs, even when
    a piece is shorter than W-1."""
    x, weight = conv_inputs(9, seed=5)
    y_full, state_full = causal_conv1d(x, weight)
    y1, state = causal_conv1d(x[:, :split], weight)
    y2, state = causal_conv1d(x[:, split:split + 1], weight, state)
    y3, state = causal_conv1d(x[:, split + 1:], weight, state)
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=1), y_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, state_full)


def test_conv_keeps_input_dtype_and_computes_in_weight_dtype() -> None:
    x, weight = conv_inputs(6)
    y, state = causal_conv1d(x.bfloat16(), weight)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), causal_conv1d(x.bfloat16().float(), weight)[0], rtol=1e-2, atol=1e-2)


def test_conv_rejects_bad_shapes() -> None:
    x, weight = conv_inputs(4)
    with pytest.raises(ValueError, match="^weight"):
        causal_conv1d(x, weight[:3])
    with pytest.raises(ValueError, match="^state"):
        causal_conv1d(x, weight, torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="^x"):
        causal_conv1d(x[0], weight)
