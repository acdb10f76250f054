"""Multi-head latent attention (MLA): expanded prefill form and absorbed decode forms.

Shapes: B batch, T queries, S key slots, H heads, Dn / Dr / Dv the nope / rope / value head
dims (Dr may be 0: K3 and Kimi Linear are NoPE), R the latent (kv_lora) rank.

Positions. Keys are indexed by absolute position 0..S-1 (slot s holds the token at position
s). Query t of row b sits at absolute position `q_positions[b, t]`, and sees key s iff

    s <= q_positions[b, t]   and   s < kv_lengths[b]

so one rule covers training (q_positions = arange(T)), chunked prefill (a chunk at an offset)
and decode (T = 1 at position past_len), with ragged rows (padding beyond kv_lengths). A query
that sees no key (kv_lengths[b] = 0, or a negative position marking a padded query) outputs
zeros, never NaN. DSA passes `selected` [B, T, S] to further restrict what each query sees.

Every form computes scores = (q_nope . k_nope + q_pe . k_pe) * scale, softmax in fp32, output
in the value dtype. The fast forms call `scaled_dot_product_attention` on fp32 copies with a
boolean mask (exact to fp32 rounding, and several times faster on CPU than a hand-written
softmax); `mla_attention_reference` spells the math out and is what tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltamoe.ops.shapes import check_shape


def visible_keys(q_positions: torch.Tensor, kv_lengths: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, T, S]: key s is visible to query t iff s <= q_positions[b,t] and s < kv_lengths[b].

    The single definition of causality + padding, shared by MLA and the DSA top-k.
    """
    _check_visibility(q_positions, kv_lengths)
    slots = torch.arange(num_keys, device=q_positions.device)
    return (slots <= q_positions[..., None]) & (slots < kv_lengths[:, None, None])


def visible_counts(q_positions: torch.Tensor, kv_lengths: torch.Tensor, num_keys: int) -> torch.Tensor:
    """long [B, T]: how many keys each query sees. `visible_keys` is always a prefix of the slots,
    [0, n) with n = min(q_position + 1, kv_length), so this count says the same in one number."""
    _check_visibility(q_positions, kv_lengths)
    return torch.minimum(q_positions + 1, kv_lengths[:, None]).clamp(min=0, max=num_keys)


def _check_visibility(q_positions: torch.Tensor, kv_lengths: torch.Tensor) -> None:
    if q_positions.dim() != 2 or q_positions.is_floating_point():
        got = f"{q_positions.dtype} {tuple(q_positions.shape)}"
        raise ValueError(f"q_positions: expected integer shape [B, T], got {got}")
    check_shape("kv_lengths", kv_lengths, "[B]", (q_positions.shape[0],))


def _allowed_keys(
    q_positions: torch.Tensor, kv_lengths: torch.Tensor, selected: torch.Tensor | None, batch: int, time: int,
    num_keys: int,
) -> torch.Tensor:
    """bool [B, T, S]: `visible_keys`, further restricted to `selected` when DSA gives one."""
    check_shape("q_positions", q_positions, "[B, T]", (batch, time))
    visible = visible_keys(q_positions, kv_lengths, num_keys)
    if selected is None:
        return visible
    check_shape("selected", selected, "[B, T, S]", (batch, time, num_keys))
    if selected.dtype != torch.bool:
        raise ValueError(f"selected: expected dtype torch.bool, got {selected.dtype}")
    return visible & selected


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention in fp32 -> [N, H, T, Ev].

    q [N, H, T, E]; k [N, Hk, S, E] and v [N, Hk, S, Ev] with Hk = H or 1 (one latent "head"
    shared by all query heads, the absorbed/MQA form); visible bool [N, T, S].
    """
    n, heads, time, _ = q.shape
    if k.shape[2] == 0:  # nothing cached at all: every query sees no key
        return q.new_zeros(n, heads, time, v.shape[-1], dtype=torch.float32)
    has_key = visible.any(dim=-1)  # [N, T]
    # A row with no visible key would be a softmax over nothing (NaN in forward or backward
    # on some backends). Let it attend everywhere, then overwrite its output with zeros.
    mask = (visible | ~has_key[..., None])[:, None]  # [N, 1, T, S]
    if k.shape[1] == 1 and heads > 1:
        # One latent "head" shared by all query heads (absorbed / MQA form): plain broadcast matmuls.
        # On CPU, SDPA's enable_gqa path expands K/V per head and is ~100x slower at long S.
        # Heads fold into the query axis ([N, H*T, E] @ [N, E, S]): a broadcast matmul would
        # first copy the shared key once per head.
        num_keys = k.shape[2]
        scores = torch.bmm(q.float().reshape(n, heads * time, -1), k[:, 0].float().transpose(1, 2)) * scale
        scores = scores.view(n, heads, time, num_keys).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs.view(n, heads * time, num_keys), v[:, 0].float()).view(n, heads, time, -1)
    else:
        out = sdpa_any_value_dim(q.float(), k.float(), v.float(), mask, scale)
    return out.masked_fill(~has_key[:, None, :, None], 0.0)


def sdpa_any_value_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """`scaled_dot_product_attention` with the query/key and value head dims made equal by zero
    padding, the output cut back to the value dim. Torch's fused CPU (flash) kernel runs only when
    they agree, and MLA's differ (nope + rope against the value dim); otherwise its math path
    materialises every score (2.9x slower for 4 heads x 1,024 tokens, 48 against 32 dims, with a
    causal mask). Zero value columns leave the others as they are; zero query/key columns add
    nothing to a score; `scale` is explicit, so padding never changes it."""
    e, ev = q.shape[-1], v.shape[-1]
    if ev < e:
        v = F.pad(v, (0, e - ev))
    elif e < ev:
        q, k = F.pad(q, (0, ev - e)), F.pad(k, (0, ev - e))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out if out.shape[-1] == ev else out[..., :ev]


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expanded MLA (prefill / training) -> o [B, T, H, Dv] in v.dtype.

    q_nope [B,T,H,Dn], q_pe [B,T,H,Dr], k_nope [B,S,H,Dn], k_pe [B,S,Dr] (one rope key for all
    heads), v [B,S,H,Dv]; q_positions [B,T] long, kv_lengths [B]; selected bool [B,T,S] or None.
    """
    _check_expanded(q_nope, q_pe, k_nope, k_pe, v)
    batch, time, heads, _ = q_nope.shape
    rope, num_keys = q_pe.shape[-1], k_nope.shape[1]
    visible = _allowed_keys(q_positions, kv_lengths, selected, batch, time, num_keys)
    # Concatenate in fp32: the softmax runs in fp32 anyway, and mixed input dtypes stay exact.
    q = torch.cat((q_nope.float(), q_pe.float()), dim=-1).transpose(1, 2)  # [B,H,T,Dn+Dr]
    k_rope = k_pe.float()[:, :, None, :].expand(batch, num_keys, heads, rope)
    k = torch.cat((k_nope.float(), k_rope), dim=-1).transpose(1, 2)  # [B,H,S,Dn+Dr]
    out = _attend(q, k, v.transpose(1, 2), visible, scale)
    return out.transpose(1, 2).to(v.dtype)


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Readable reference for `mla_attention`: explicit scores, masked fp32 softmax, weighted sum."""
    _check_expanded(q_nope, q_pe, k_nope, k_pe, v)
    batch, time, _, _ = q_nope.shape
    visible = _allowed_keys(q_positions, kv_lengths, selected, batch, time, k_nope.shape[1])
    scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.float(), k_pe.float())
    scores = scores * scale
    has_key = visible.any(dim=-1)[:, None, :, None]  # [B,1,T,1]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    scores = scores.masked_fill(~has_key, 0.0)  # keep the softmax finite; zeroed below
    probs = torch.softmax(scores, dim=-1).masked_fill(~has_key, 0.0)
    return torch.einsum("bhts,bshv->bthv", probs, v.float()).to(v.dtype)


def _check_expanded(
    q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor
) -> None:
    if q_nope.dim() != 4:
        raise ValueError(f"q_nope: expected shape [B, T, H, Dn], got {tuple(q_nope.shape)}")
    batch, time, heads, nope = q_nope.shape
    check_shape("q_pe", q_pe, "[B, T, H, Dr]", (batch, time, heads, None))
    rope = q_pe.shape[-1]
    check_shape("k_nope", k_nope, "[B, S, H, Dn]", (batch, None, heads, nope))
    num_keys = k_nope.shape[1]
    check_shape("k_pe", k_pe, "[B, S, Dr]", (batch, num_keys, rope))
    check_shape("v", v, "[B, S, H, Dv]", (batch, num_keys, heads, None))


def absorb_kv_b(
    kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split kv_b_proj.weight [H*(Dn+Dv), R] into w_uk [H, Dn, R] and w_uv [H, Dv, R].

    kv_b's output is laid out per head as [k_nope | v] (transformers kimi_linear and
    deepseek_v3/v32 view it as [.., H, Dn+Dv] and split), so k_nope[h] = w_uk[h] @ latent and
    v[h] = w_uv[h] @ latent. Returns views of the weight (no copy).
    """
    check_shape("kv_b_weight", kv_b_weight, "[H*(Dn+Dv), R]", (num_heads * (nope_dim + v_dim), None))
    per_head = kv_b_weight.view(num_heads, nope_dim + v_dim, kv_b_weight.shape[1])
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def _check_queries(q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple[int, int, int, int]:
    """q_nope [B, T, H, Dn] and q_pe [B, T, H, Dr] of every absorbed form -> (B, T, H, Dn)."""
    if q_nope.dim() != 4:
        raise ValueError(f"q_nope: expected shape [B, T, H, Dn], got {tuple(q_nope.shape)}")
    batch, time, heads, nope = q_nope.shape
    check_shape("q_pe", q_pe, "[B, T, H, Dr]", (batch, time, heads, None))
    return batch, time, heads, nope


def _check_absorb_weights(w_uk: torch.Tensor, w_uv: torch.Tensor, heads: int, nope: int, rank: int) -> None:
    check_shape("w_uk", w_uk, "[H, Dn, R]", (heads, nope, rank))
    check_shape("w_uv", w_uv, "[H, Dv, R]", (heads, None, rank))


def _absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_nope . w_uk | q_pe] in fp32 -> [B, T, H, R+Dr]: a query in the latent key space."""
    q_latent = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())
    return torch.cat((q_latent, q_pe.float()), dim=-1)


def mla_attention_absorbed_joined(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    joined: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the compressed cache -> o [B, T, H, Dv] in joined.dtype.

    joined [B, S, R+Dr] = [normed c_kv latent | k_pe], the row layout a cache stores and hands
    back (`ModelCache.append_latent`), so nothing is split or copied; w_uk / w_uv from
    `absorb_kv_b`. Because k_nope = w_uk latent and v = w_uv latent, q_nope . k_nope =
    (q_nope w_uk) . latent and P v = w_uv (P latent): attention runs as multi-query attention over
    one latent "head" of width R+Dr, and the per-head up-projection is applied once to the output.
    """
    batch, time, heads, nope = _check_queries(q_nope, q_pe)
    rank = w_uk.shape[-1]
    check_shape("joined", joined, "[B, S, R+Dr]", (batch, None, rank + q_pe.shape[-1]))
    _check_absorb_weights(w_uk, w_uv, heads, nope, rank)
    visible = _allowed_keys(q_positions, kv_lengths, selected, batch, time, joined.shape[1])
    q = _absorb_query(q_nope, q_pe, w_uk).transpose(1, 2)  # [B,H,T,R+Dr]
    k = joined.float()[:, None]  # [B,1,S,R+Dr]
    out_latent = _attend(q, k, k[..., :rank], visible, scale)  # [B,H,T,R]
    return torch.einsum("bhtr,hvr->bthv", out_latent, w_uv.float()).to(joined.dtype)


def mla_attention_absorbed_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    valid: torch.Tensor,
) -> torch.Tensor:
    """DSA decode: absorbed MLA over only each query's K selected keys -> o [B, T, H, Dv] in rows.dtype.

    rows [B, T*K, R+Dr] are the cached [latent | k_pe] rows of each query's K selected keys, query
    by query (a cache reads just these with `ModelCache.latent_rows`, at the slots of
    `dsa.causal_topk`); valid bool [B, T, K] marks the real ones. Cost scales with K, not S.
    Visibility is entirely the caller's (the top-k already applied causality and lengths), so this
    equals `mla_attention_absorbed_joined(..., selected=topk_mask(indices, valid, S))`.
    """
    batch, time, heads, nope = _check_queries(q_nope, q_pe)
    check_shape("valid", valid, "[B, T, K]", (batch, time, None))
    if valid.dtype != torch.bool:
        raise ValueError(f"valid: expected dtype torch.bool, got {valid.dtype}")
    top = valid.shape[-1]
    rank = w_uk.shape[-1]
    check_shape("rows", rows, "[B, T*K, R+Dr]", (batch, time * top, rank + q_pe.shape[-1]))
    _check_absorb_weights(w_uk, w_uv, heads, nope, rank)
    gathered = rows.float().view(batch * time, 1, top, -1)
    # Each query becomes its own batch entry attending to its own K gathered slots.
    q = _absorb_query(q_nope, q_pe, w_uk).reshape(batch * time, heads, 1, -1)
    out_latent = _attend(q, gathered, gathered[..., :rank], valid.reshape(batch * time, 1, top), scale)
    out_latent = out_latent.view(batch, time, heads, rank)
    return torch.einsum("bthr,hvr->bthv", out_latent, w_uv.float()).to(rows.dtype)
