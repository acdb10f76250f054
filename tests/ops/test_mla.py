"""MLA: fast vs reference, absorbed vs expanded, selected rows vs mask, RoPE properties."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.mla import (
    absorb_kv_b,
    mla_attention,
    mla_attention_absorbed_joined,
    mla_attention_absorbed_rows,
    mla_attention_reference,
    visible_keys,
)
from deltamoe.ops.rope import apply_rope, rope_cos_sin

B, H, NOPE, VDIM, RANK = 2, 3, 16, 16, 12

# (queries T, key slots S, per-row start position of the queries, per-row kv length).
# Row lengths differ; "prefill" row 1 is right-padded, so its last queries are padding.
SCENARIOS = {
    "prefill": (37, 37, [0, 0], [37, 23]),
    "chunk": (5, 20, [15, 9], [20, 14]),
    "decode": (1, 12, [11, 6], [12, 7]),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def positions(time: int, starts: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    q_positions = torch.tensor(starts)[:, None] + torch.arange(time)
    return q_positions, torch.tensor(lengths)


def expanded_inputs(gen: torch.Generator, time: int, keys: int, rope: int) -> tuple[torch.Tensor, ...]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return (randn(B, time, H, NOPE), randn(B, time, H, rope), randn(B, keys, H, NOPE), randn(B, keys, rope),
            randn(B, keys, H, VDIM))


def latent_inputs(gen: torch.Generator, time: int, keys: int, rope: int) -> dict[str, torch.Tensor]:
    """Queries, a latent cache and a kv_b weight, plus k_nope / v expanded the transformers way."""
    latent = torch.randn(B, keys, RANK, generator=gen)
    kv_b = torch.randn(H * (NOPE + VDIM), RANK, generator=gen) / RANK**0.5
    # transformers (kimi_linear, deepseek_v3/v32): kv_b_proj(latent).view(.., H, Dn+Dv).split([Dn, Dv])
    k_nope, v = (latent @ kv_b.T).view(B, keys, H, NOPE + VDIM).split([NOPE, VDIM], dim=-1)
    return {
        "q_nope": torch.randn(B, time, H, NOPE, generator=gen),
        "q_pe": torch.randn(B, time, H, rope, generator=gen),
        "latent": latent,
        "k_pe": torch.randn(B, keys, rope, generator=gen),
        "kv_b": kv_b,
        "k_nope": k_nope,
        "v": v,
    }


def joined(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The cache's row layout [latent | k_pe] -> [B, S, R+Dr]."""
    return torch.cat((x["latent"], x["k_pe"]), dim=-1)


def selected_rows(rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """What a cache's `latent_rows` hands DSA decode: each query's K selected rows -> [B, T*K, R+Dr]."""
    slots = indices.masked_fill(~valid, 0).reshape(rows.shape[0], -1)
    return rows.gather(1, slots[..., None].expand(-1, -1, rows.shape[-1]))


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fast_matches_reference(scenario: str, rope: int) -> None:
    time, keys, starts, lengths = SCENARIOS[scenario]
    gen = torch.Generator().manual_seed(10 * list(SCENARIOS).index(scenario) + rope)
    q_nope, q_pe, k_nope, k_pe, v = expanded_inputs(gen, time, keys, rope)
    q_positions, kv_lengths = positions(time, starts, lengths)
    scale = (NOPE + rope) ** -0.5
    for selected in (None, torch.rand(B, time, keys, generator=gen) < 0.5):
        kwargs = dict(scale=scale, q_positions=q_positions, kv_lengths=kv_lengths, selected=selected)
        fast = mla_attention(q_nope, q_pe, k_nope, k_pe, v, **kwargs)
        ref = mla_attention_reference(q_nope, q_pe, k_nope, k_pe, v, **kwargs)
        assert fast.shape == (B, time, H, VDIM) and fast.dtype == v.dtype
        assert rel_err(fast, ref) <= 1e-5


def test_bfloat16_inputs_give_bfloat16_output_close_to_fp32() -> None:
    gen = torch.Generator().manual_seed(9)
    tensors = expanded_inputs(gen, 5, 20, 8)
    q_positions, kv_lengths = positions(5, [15, 9], [20, 14])
    kwargs = dict(scale=0.2, q_positions=q_positions, kv_lengths=kv_lengths)
    exact = mla_attention_reference(*tensors, **kwargs)
    low = mla_attention(*(t.bfloat16() for t in tensors), **kwargs)
    assert low.dtype == torch.bfloat16
    assert rel_err(low.float(), exact) <= 2e-2  # bf16 rounding of the inputs and the output only


def test_reference_is_a_causal_softmax() -> None:
    """The reference itself, spelled out for one query: softmax over keys 0..pos, weighted v."""
    gen = torch.Generator().manual_seed(1)
    q_nope, q_pe, k_nope, k_pe, v = expanded_inputs(gen, 4, 9, 8)
    q_positions, kv_lengths = positions(4, [3, 3], [7, 5])
    out = mla_attention_reference(q_nope, q_pe, k_nope, k_pe, v, scale=0.25, q_positions=q_positions,
                                  kv_lengths=kv_lengths)
    b, t, h = 1, 2, 1  # position 5, row length 5 -> keys 0..4
    scores = (k_nope[b, :5, h] @ q_nope[b, t, h] + k_pe[b, :5] @ q_pe[b, t, h]) * 0.25
    expected = torch.softmax(scores, dim=0) @ v[b, :5, h]
    torch.testing.assert_close(out[b, t, h], expected, rtol=1e-6, atol=1e-6)


def test_visible_keys_convention() -> None:
    visible = visible_keys(torch.tensor([[0, 4], [2, -1]]), torch.tensor([6, 2]), 6)
    assert visible[0, 0].tolist() == [True, False, False, False, False, False]
    assert visible[0, 1].tolist() == [True] * 5 + [False]
    assert visible[1, 0].tolist() == [True, True, False, False, False, False]  # length 2 caps position 2
    assert not visible[1, 1].any()  # a negative position marks a padded query


def test_query_without_keys_is_zero_and_has_finite_grad() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = [t.requires_grad_() for t in expanded_inputs(gen, 3, 5, 8)]
    q_positions = torch.tensor([[0, 1, -1], [0, 1, 2]])
    kv_lengths = torch.tensor([5, 0])  # row 1 has an empty cache; row 0's last query is padding
    kwargs = dict(scale=0.2, q_positions=q_positions, kv_lengths=kv_lengths)
    for attention in (mla_attention, mla_attention_reference):
        out = attention(*tensors, **kwargs)
        assert torch.isfinite(out).all()
        assert out[1].abs().max() == 0 and out[0, 2].abs().max() == 0
        assert out[0, :2].abs().max() > 0
        out.square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in tensors)
        for t in tensors:
            t.grad = None


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_absorbed_matches_expanded(scenario: str, rope: int) -> None:
    time, keys, starts, lengths = SCENARIOS[scenario]
    gen = torch.Generator().manual_seed(100 + 10 * list(SCENARIOS).index(scenario) + rope)
    x = latent_inputs(gen, time, keys, rope)
    q_positions, kv_lengths = positions(time, starts, lengths)
    w_uk, w_uv = absorb_kv_b(x["kv_b"], H, NOPE, VDIM)
    kwargs = dict(scale=(NOPE + rope) ** -0.5, q_positions=q_positions, kv_lengths=kv_lengths)
    expanded = mla_attention_reference(x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], **kwargs)
    absorbed = mla_attention_absorbed_joined(x["q_nope"], x["q_pe"], joined(x), w_uk, w_uv, **kwargs)
    assert absorbed.shape == (B, time, H, VDIM)
    assert rel_err(absorbed, expanded) <= 1e-5


def test_absorb_kv_b_matches_transformers_expand_kv() -> None:
    """Layout oracle: DeepseekV32Attention.expand_kv (same kv_b layout as kimi_linear)."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    config = DeepseekV32Config(hidden_size=32, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=24,
                               kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=8, v_head_dim=VDIM,
                               index_n_heads=2, index_head_dim=16, num_hidden_layers=1)
    torch.manual_seed(3)
    attention = DeepseekV32Attention(config, 0)
    latent, k_rot = torch.randn(B, 1, 7, RANK), torch.randn(B, 1, 7, 8)
    with torch.no_grad():
        keys, values = attention.expand_kv(latent, k_rot)  # [B, H, S, Dn+Dr], [B, H, S, Dv]
    w_uk, w_uv = absorb_kv_b(attention.kv_b_proj.weight.detach(), H, NOPE, VDIM)
    assert w_uk.shape == (H, NOPE, RANK) and w_uv.shape == (H, VDIM, RANK)
    torch.testing.assert_close(torch.einsum("hdr,bsr->bhsd", w_uk, latent[:, 0]), keys[..., :NOPE])
    torch.testing.assert_close(torch.einsum("hvr,bsr->bhsv", w_uv, latent[:, 0]), values)


def random_selection(gen: torch.Generator, visible: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, up to `top` distinct visible slots in random order; the rest invalid and -1."""
    batch, time, _ = visible.shape
    indices = torch.full((batch, time, top), -1)
    for b in range(batch):
        for t in range(time):
            slots = visible[b, t].nonzero().flatten()
            count = int(torch.randint(0, min(top, len(slots)) + 1, (), generator=gen))
            indices[b, t, :count] = slots[torch.randperm(len(slots), generator=gen)[:count]]
    return indices, indices >= 0


@pytest.mark.parametrize("rope", [8, 0])
def test_selected_rows_match_masked(rope: int) -> None:
    time, keys, top = 6, 19, 4
    gen = torch.Generator().manual_seed(4 + rope)
    x = latent_inputs(gen, time, keys, rope)
    w_uk, w_uv = absorb_kv_b(x["kv_b"], H, NOPE, VDIM)
    q_positions, kv_lengths = positions(time, [13, 0], [19, 6])
    indices, valid = random_selection(gen, visible_keys(q_positions, kv_lengths, keys), top)
    selected = torch.zeros(B, time, keys, dtype=torch.bool)
    rows, cols, ks = valid.nonzero(as_tuple=True)
    selected[rows, cols, indices[rows, cols, ks]] = True
    sparse = mla_attention_absorbed_rows(x["q_nope"], x["q_pe"], selected_rows(joined(x), indices, valid), w_uk, w_uv,
                                         scale=0.3, valid=valid)
    masked = mla_attention_absorbed_joined(x["q_nope"], x["q_pe"], joined(x), w_uk, w_uv, scale=0.3,
                                           q_positions=q_positions, kv_lengths=kv_lengths, selected=selected)
    assert rel_err(sparse, masked) <= 1e-5
    empty = ~valid.any(-1)
    assert empty.any() and (~empty).any() and sparse[empty].abs().max() == 0


def test_bad_shapes_name_the_tensor() -> None:
    gen = torch.Generator().manual_seed(5)
    q_nope, q_pe, k_nope, k_pe, v = expanded_inputs(gen, 3, 5, 8)
    q_positions, kv_lengths = positions(3, [2, 2], [5, 5])
    kwargs = dict(scale=0.2, q_positions=q_positions, kv_lengths=kv_lengths)
    with pytest.raises(ValueError, match=r"k_pe: expected shape \[B, S, Dr\]"):
        mla_attention(q_nope, q_pe, k_nope, k_pe[:, :, :4], v, **kwargs)
    with pytest.raises(ValueError, match="selected"):
        mla_attention(q_nope, q_pe, k_nope, k_pe, v, selected=torch.ones(B, 3, 4, dtype=torch.bool), **kwargs)
    with pytest.raises(ValueError, match=r"q_positions: expected shape \[B, T\]"):
        mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale=0.2, q_positions=q_positions[:, :2], kv_lengths=kv_lengths)
    with pytest.raises(ValueError, match="kv_lengths"):
        mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale=0.2, q_positions=q_positions, kv_lengths=kv_lengths[:1])
    with pytest.raises(ValueError, match=r"kv_b_weight: expected shape \[H\*\(Dn\+Dv\), R\]"):
        absorb_kv_b(torch.zeros(10, RANK), H, NOPE, VDIM)
    w_uk, w_uv = absorb_kv_b(torch.zeros(H * (NOPE + VDIM), RANK), H, NOPE, VDIM)
    with pytest.raises(ValueError, match=r"joined: expected shape \[B, S, R\+Dr\]"):
        mla_attention_absorbed_joined(q_nope, q_pe, torch.zeros(B, 5, RANK + 1), w_uk, w_uv, **kwargs)
    valid = torch.ones(B, 3, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"rows: expected shape \[B, T\*K, R\+Dr\]"):
        mla_attention_absorbed_rows(q_nope, q_pe, torch.zeros(B, 5, RANK + 8), w_uk, w_uv, scale=0.2, valid=valid)
    with pytest.raises(ValueError, match="valid: expected dtype torch.bool"):
        mla_attention_absorbed_rows(q_nope, q_pe, torch.zeros(B, 6, RANK + 8), w_uk, w_uv, scale=0.2,
                                    valid=valid.long())


# --- RoPE -------------------------------------------------------------------------------


def test_rope_preserves_norms_and_dtype() -> None:
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, 7, H, 8, generator=gen)
    cos, sin = rope_cos_sin(torch.randint(0, 10_000, (B, 7), generator=gen), 8, 10_000.0)
    rotated = apply_rope(q, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(rotated, q)
    assert apply_rope(q.bfloat16(), cos, sin).dtype == torch.bfloat16
    torch.testing.assert_close(apply_rope(q, cos[:, :, None], sin[:, :, None]), rotated)  # pre-unsqueezed tables


def test_rope_dot_product_depends_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 1, 16, generator=gen), torch.randn(1, 1, 16, generator=gen)

    def dot(q_pos: int, k_pos: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([[q_pos]]), 16, 10_000.0)
        ck, sk = rope_cos_sin(torch.tensor([[k_pos]]), 16, 10_000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert dot(5, 2) == pytest.approx(dot(103, 100), rel=1e-4)
    assert dot(5, 2) == pytest.approx(dot(3, 0), rel=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 3), rel=1e-3)


def test_rope_matches_transformers_rotate_half() -> None:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(8)
    pos = torch.tensor([[0, 1, 7, 300], [5, 6, 7, 8]])
    cos, sin = rope_cos_sin(pos, 8, 10_000.0)
    q, k = torch.randn(B, 4, H, 8, generator=gen), torch.randn(B, 4, 1, 8, generator=gen)
    inv_freq = 1.0 / 10_000.0 ** (torch.arange(0, 8, 2).float() / 8)  # transformers' default rope
    angles = pos[..., None].float() * inv_freq
    hf_cos, hf_sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_hf, k_hf = apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=2)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf)
    torch.testing.assert_close(apply_rope(k[:, :, 0], cos, sin), k_hf[:, :, 0])


@pytest.mark.parametrize("e, ev", [(48, 32), (32, 48), (40, 40)])
def test_sdpa_any_value_dim_is_attention_on_the_fused_kernel(e: int, ev: int) -> None:
    """Query/key and value head dims made equal by zero padding: the same attention as the math
    written out (a causal mask with an empty first row, as `_attend` passes it), on torch's fused
    CPU kernel (unequal dims sent SDPA to its math path)."""
    from torch.profiler import ProfilerActivity, profile

    from deltamoe.ops.mla import sdpa_any_value_dim

    g = torch.Generator().manual_seed(e + ev)
    n, h, t = 2, 3, 40
    q, k = torch.randn(n, h, t, e, generator=g), torch.randn(n, h, t, e, generator=g)
    v = torch.randn(n, h, t, ev, generator=g)
    mask = torch.ones(t, t, dtype=torch.bool).tril(-1)
    mask[0, 0] = True  # `_attend` lets a row without keys see everything, then zeroes it
    mask = mask[None, None].expand(n, 1, t, t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = sdpa_any_value_dim(q, k, v, mask, 0.3)
    names = {ev_.key for ev_ in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v
    assert got.shape == (n, h, t, ev)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
