"""Kimi Delta Attention (KDA): the gated delta rule with a per-key-channel decay.

Per head, with a state S in R^{K x V} kept in fp32 (spec §4.2):

    S'  = Diag(exp g_t) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale q_t)

Three forms of this one recurrence:

- `recurrent_kda`: the readable reference, one token at a time (fla's `naive_recurrent_kda`).
- `chunk_kda`: the chunked WY / UT-transform form for prefill and training (derivation below).
- `kda_step`: one decode token for N sequences at once (the model's decode path; the cache hands
  it their states, and takes the new ones back).

Conventions (as fla): q, k [B, T, H, K]; v [B, T, H, V]; g = log-decay [B, T, H, K] (<= 0);
beta [B, T, H] (already sigmoid-ed); state [B, H, K, V] fp32; scale defaults to K^-1/2.
Everything is computed in fp32 (fp64 if an input is fp64), inside an autocast region too (its bf16
matmuls would round the state and the deltas); o comes back in v.dtype, the state in the compute
dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from deltamoe.ops import kda_fused
from deltamoe.ops.autocast import full_precision
from deltamoe.ops.shapes import check_shape

L2NORM_EPS = 1e-6  # fla's "in kernel" l2norm: x / sqrt(sum x^2 + eps), not F.normalize's max(., eps)

# Largest decay span (sum of -g) inside one chunk of `chunk_kda`: the factorized scores then use
# factors within e^{+-60}, far from fp32 overflow (e^88) and underflow (e^-87).
MAX_CHUNK_SPAN = 120.0

# `chunk_kda` works through the sequence in groups of chunks holding about this many values per
# [B, H, T, K] tensor (1 MiB in fp32), e.g. 1024 tokens at B=1, H=8, K=32.
GROUP_ELEMENTS = 1 << 18

# Bounds of the default chunk length. A token's share of the C x C scores and of the triangular
# solve grows with C, its share of the K- and V-wide products with K, and the loop over chunks
# runs T / C steps: a chunk about as long as a head is wide balances them (bench/kda_cost_split.py).
MIN_DEFAULT_CHUNK, MAX_DEFAULT_CHUNK = 16, 64


def default_chunk_size(head_dim: int) -> int:
    """The chunked forms' longest chunk when the caller names none: the key head size, within
    [MIN_DEFAULT_CHUNK, MAX_DEFAULT_CHUNK] (16 for `tiny`'s K = 16, 64 for K3's K = 128)."""
    return min(MAX_DEFAULT_CHUNK, max(MIN_DEFAULT_CHUNK, head_dim))


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's in-kernel l2norm (not F.normalize's max)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """Validate the [B, T, H, *] layout of a sequence call; returns (B, T, H, K, V)."""
    check_shape("q", q, "[B, T, H, K]", [None] * 4)
    b, t, h, dk = q.shape
    check_shape("k", k, "[B, T, H, K]", [b, t, h, dk])
    check_shape("v", v, "[B, T, H, V]", [b, t, h, None])
    dv = v.shape[-1]
    check_shape("g", g, "[B, T, H, K]", [b, t, h, dk])
    check_shape("beta", beta, "[B, T, H]", [b, t, h])
    if initial_state is not None:
        check_shape("initial_state", initial_state, "[B, H, K, V]", [b, h, dk, dv])
    return b, t, h, dk, dv


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when an input already is (so that gradcheck can run in double)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _upcast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool
) -> tuple[torch.Tensor, ...]:
    """Cast to the compute dtype first, then (optionally) l2-normalize q and k: fla's order."""
    dtype = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q, k, v, g, beta


def _delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of heads.

    state [..., K, V]; q (already scaled), k, g [..., K]; v [..., V]; beta [...].
    Returns (o [..., V], new state [..., K, V]).
    """
    state = state * g.exp().unsqueeze(-1)
    # The contractions over K as broadcast multiply-sums: for batches of small [K, V] states these
    # are several times faster on a CPU than einsum's batched matmuls.
    predicted = (k.unsqueeze(-1) * state).sum(-2)  # what the decayed memory recalls for k
    delta = beta.unsqueeze(-1) * (v - predicted)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-1) * state).sum(-2), state


@full_precision
def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA: the recurrence token by token. Returns (o [B, T, H, V], final state or None)."""
    b, t, h, dk, dv = _check_inputs(q, k, v, g, beta, initial_state)
    scale = dk**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = _upcast_inputs(q, k, v, g, beta, use_qk_l2norm)
    q = q * scale
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for i in range(t):
        o_i, state = _delta_step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        outputs.append(o_i)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(b, 0, h, dv)
    return o.to(out_dtype), (state if output_final_state else None)


@full_precision
def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for N sequences, given their current states (`ModelCache.kda_state`).

    q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state [N, H, K, V] (not modified: the caller
    stores the returned state, e.g. a paged cache back into its slot pool).
    Returns (o [N, H, V] in v.dtype, new state [N, H, K, V] in the compute dtype).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = _upcast_inputs(q, k, v, g, beta, use_qk_l2norm)
    o, state = _delta_step(state.to(q.dtype), q * scale, k, v, g, beta)
    return o.to(out_dtype), state


@full_precision
def kda_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_step` over T tokens of N sequences, keeping the state after every token: what
    speculative verification needs to roll back to any accepted draft (serve/spec_decode/).

    q, k, g [N, T, H, K]; v [N, T, H, V]; beta [N, T, H]; state [N, H, K, V] (not modified).
    Inputs are cast and normalized once for all T tokens, not once per token.
    Returns (o [N, T, H, V] in v.dtype, states [N, T, H, K, V] in the compute dtype).
    """
    _check_inputs(q, k, v, g, beta, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = _upcast_inputs(q, k, v, g, beta, use_qk_l2norm)
    q = q * scale
    state = state.to(q.dtype)
    outputs, states = [], []
    for i in range(q.shape[1]):
        o_i, state = _delta_step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        outputs.append(o_i)
        states.append(state)
    return torch.stack(outputs, 1).to(out_dtype), torch.stack(states, 1)


# ---------------------------------------------------------------------------------------------
# Chunked form.
#
# Split the sequence into chunks of C tokens. Inside a chunk let G_i = g_0 + ... + g_i be the
# cumulative log-decay since the chunk start (<= 0, non-increasing) and S_0 the state before it.
# Write the delta of token i as u_i = beta_i (v_i - k_i^T Diag(e^{g_i}) S_{i-1}); unrolling,
#
#     S_i = Diag(e^{G_i}) S_0 + sum_{j<=i} Diag(e^{G_i - G_j}) k_j u_j^T.
#
# Substituting S_{i-1} into u_i gives a unit lower-triangular system for all deltas at once:
#
#     (I + L) u = beta v - beta (k * e^G) S_0,    L_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}  (j < i)
#     =>  u = U - W S_0,  [U | W] = (I + L)^-1 [beta v | beta k * e^G]     (the WY / UT transform)
#
# and with M_ij = scale sum_c q_ic k_jc e^{G_ic - G_jc} (j <= i) and Kd_j = k_j * e^{G_last - G_j}:
#
#     o         = (scale q * e^G) S_0 + M u
#     S_{next}  = Diag(e^{G_last}) S_0 + Kd^T u.
#
# Everything that does not involve S_0 (M, L, the inverse of I + L, U, W) is computed for all
# chunks of a group at once, in batched matmuls (`_chunk_terms`); the loop over chunks
# (`_state_pass`) only runs the three C x K x V products above (W S_0, q S_0, Kd^T u) and the small
# M u. The inverse is one batched triangular solve
# against the identity, then a matmul: much faster than solving against the K + V columns.
# Without autograd (prefill) the loop writes every product into buffers allocated once per group
# and updates the state in place; with it, each product is a new tensor, since backward reads the
# state entering every chunk.
#
# Numerics. e^{G_i - G_j} = e^{G_i - r} e^{r - G_j} makes L and M plain matmuls; with r halfway
# through the chunk's decay both factors stay within e^{+-span/2}, where span = G_0 - G_last =
# -(g_1 + ... + g_{C-1}). `_pick_chunk_size` halves C until every chunk has span <=
# MAX_CHUNK_SPAN, so no exp() ever sees a large positive number (C = 1 has span 0). The exponents
# H_i - r (H_i = G_i - g_0, r = H_last / 2) are one matmul of g with a constant matrix of 0 and
# +-1/2 that leaves g_0 out: their rounding is bounded by the span, not by how much decayed before
# (e.g. a huge g_0).
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _pick_chunk_size(g: torch.Tensor, chunk_size: int) -> int:
    """Largest chunk length (chunk_size, halved as needed) whose chunks all have span <= MAX_CHUNK_SPAN.

    g [B, T, H, K] <= 0. The span of a chunk is -(g_1 + ... + g_{C-1}): its first token's decay
    never enters a difference. Typical gates keep C = chunk_size or halve it once; a softplus gate
    with huge decays gets shorter chunks (slower, still exact) instead of an overflow.
    """
    chunk = min(chunk_size, g.shape[1])
    while chunk > 1:
        for length, span in _largest_spans(g, chunk):
            if bool(span <= MAX_CHUNK_SPAN):
                return length
        chunk //= 4 if chunk % 2 == 0 else 2  # both of (C, C / 2) were too long: C / 4 next
    return max(chunk, 1)


def _largest_spans(g: torch.Tensor, chunk: int) -> list[tuple[int, torch.Tensor]]:
    """[(C, the largest span of a chunk of C tokens), (C / 2, the same for the halves of those
    chunks)] (the second only when C is even), in one pass over g: every chunk's span and its two
    halves' are one matmul of g with a 0/1 matrix, instead of one strided sum per candidate length."""
    b, t, h, dk = g.shape
    n_chunks = -(-t // chunk)
    padded = F.pad(g, (0, 0, 0, 0, 0, n_chunks * chunk - t)) if t % chunk else g  # g = 0 adds no span
    half = chunk // 2
    sums = g.new_zeros(1 if chunk % 2 else 3, chunk)  # each row sums a (sub)chunk's tokens after its first
    sums[0, 1:] = 1.0
    if chunk % 2 == 0:
        sums[1, 1:half] = 1.0
        sums[2, half + 1 :] = 1.0
    spans = -(sums @ padded.reshape(b * n_chunks, chunk, h * dk)).amin(dim=(0, 2))  # g <= 0: span = -sum
    return [(chunk, spans[0])] + ([(half, spans[1:].max())] if chunk % 2 == 0 else [])


@full_precision
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for prefill and training: same result as `recurrent_kda`, any T, differentiable.

    `chunk_size` is the longest chunk (None: `default_chunk_size` of K, or where the fused kernel
    runs its own `kda_fused.DEFAULT_CHUNK`); a group of chunks halves it while one of its chunks
    would decay by more than e^-MAX_CHUNK_SPAN (see the notes above). g must be <= 0 (a log-decay).
    Calls that record no gradient, in fp32 on the CPU, run the fused C++ kernel (ops/kda_fused.py:
    the same chunks and steps, one (batch, head) at a time); the rest run the torch ops below.
    ops/kda_compiled.py runs the same steps with each group of chunks one compiled call.
    Returns (o [B, T, H, V] in v.dtype, final state [B, H, K, V] or None).
    """
    (b, t, h, dk, dv), scale, checked_chunk = _check_chunked_inputs(q, k, v, g, beta, initial_state, chunk_size, scale)
    dtype = _compute_dtype(q, k, v, g, beta)
    fused = checked_chunk <= kda_fused.MAX_CHUNK and kda_fused.usable(  # usable: fp32 compute, no autograd, CPU
        q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    chunk_size = kda_fused.DEFAULT_CHUNK if fused and chunk_size is None else checked_chunk
    state = q.new_zeros(b * h, dk, dv, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    state = state.reshape(b * h, dk, dv)

    # The sequence goes through in groups of whole chunks, carrying the state: a group's
    # intermediates stay in cache and reuse freed memory (instead of fresh pages from the OS), and
    # inference memory is bounded by one group instead of growing with T.
    group = chunk_size * max(1, GROUP_ELEMENTS // (b * h * chunk_size * max(dk, dv)))
    if fused:
        # The fused kernel (ops/kda_fused.py) over the same groups and chunk lengths, in a copy of
        # the state (it writes the final state into the tensor it is given).
        segments = [(start, min(start + group, t), _pick_chunk_size(g[:, start : start + group].to(dtype), chunk_size))
                    for start in range(0, t, group)]
        state = state.contiguous().clone()
        o = kda_fused.chunk_forward(q, k, v, g, beta, state, segments, scale, use_qk_l2norm, L2NORM_EPS)
        return o.to(v.dtype), (state.view(b, h, dk, dv) if output_final_state else None)
    o = v.new_empty(b, t, h, dv, dtype=dtype)  # each group's chunks are copied into their tokens
    for start in range(0, t, group):
        part = slice(start, start + group)
        chunk_o, state = _chunk_kda_group(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state, scale, use_qk_l2norm, chunk_size
        )
        _copy_to_tokens(chunk_o, o[:, part])
    return o.to(v.dtype), (state.view(b, h, dk, dv) if output_final_state else None)


def _check_chunked_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          initial_state: torch.Tensor | None, chunk_size: int | None, scale: float | None,
                          ) -> tuple[tuple[int, int, int, int, int], float, int]:
    """The checks and defaults a chunked form's arguments share (`chunk_kda`, `kda_compiled`):
    ((B, T, H, K, V), scale, chunk_size)."""
    sizes = _check_inputs(q, k, v, g, beta, initial_state)
    chunk_size = default_chunk_size(sizes[3]) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    return sizes, sizes[3] ** -0.5 if scale is None else scale, chunk_size


def _copy_to_tokens(chunk_o: torch.Tensor, tokens: torch.Tensor) -> None:
    """Lay out o of a run of chunks [N, B*H, C, V] as its tokens [B, T, H, V] (a view of the
    output), in one copy; the padding at the end of the last chunk is left out."""
    n_chunks, _, chunk, dv = chunk_o.shape
    b, t, h, _ = tokens.shape
    by_token = chunk_o.view(n_chunks, b, h, chunk, dv).permute(1, 0, 3, 2, 4)  # [B, N, C, H, V]
    full = t // chunk  # chunks without padding
    tokens[:, : full * chunk].view(b, full, chunk, h, dv).copy_(by_token[:, :full])
    if full < n_chunks:
        tokens[:, full * chunk :].copy_(by_token[:, full, : t - full * chunk])


def _centering_matrix(chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """A [C, C] with (A g)_i = H_i - H_last / 2, where H_i = g_1 + ... + g_i (g_0 left out)."""
    a = torch.ones(chunk, chunk, dtype=dtype).tril() - 0.5
    a[:, 0] = 0.0
    return a


class _ChunkTerms(NamedTuple):
    """What a run of chunks contributes independently of the state entering it: each [N, BH, ...],
    computed for all chunks at once (see the notes above)."""

    u: torch.Tensor  # U = (I + L)^-1 Diag(beta) v [N, BH, C, V]
    w: torch.Tensor  # W = (I + L)^-1 Diag(beta) (k * e^G) [N, BH, C, K]
    m_scores: torch.Tensor  # M [N, BH, C, C]
    q_decayed: torch.Tensor  # scale q * e^G [N, BH, C, K]
    k_to_end: torch.Tensor  # Kd^T [N, BH, K, C]
    chunk_decay: torch.Tensor  # e^{G_last} [N, BH, K, 1]


def _chunk_kda_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one run of tokens: (o of its chunks [N, B*H, C, V] in the compute
    dtype, the last one padded; state [B*H, K, V])."""
    dtype = _compute_dtype(q, k, v, g, beta)
    chunk = _pick_chunk_size(g.to(dtype), chunk_size)
    terms = _chunk_terms(q, k, v, g, beta, scale, use_qk_l2norm, chunk)
    return _state_pass(terms, state)


def _chunk_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk: int,
) -> _ChunkTerms:
    """Everything of a run of tokens [B, T, H, *] that does not depend on the state: batched over
    all of its chunks of `chunk` tokens (`_pick_chunk_size`'s length)."""
    b, t, h, dk = q.shape
    dtype = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))

    # Pad the tail with g = 0, k = v = beta = 0 tokens: they leave the state unchanged (decay 1,
    # no write) and their outputs are dropped.
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t

    def chunk_view(x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, *] -> [N, B, H, C, *]: chunk-major, so that each loop step reads one block."""
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        return x.reshape(b, n_chunks, chunk, h, *x.shape[3:]).permute(1, 0, 3, 2, *range(4, x.dim() + 1))

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, *] -> [N, B*H, C, *], contiguous (reshape alone may return a strided view)."""
        return chunk_view(x).reshape(n_chunks, b * h, chunk, *x.shape[3:]).contiguous()

    def normalized_chunks(x: torch.Tensor, factor: float) -> torch.Tensor:
        """factor * x (l2-normalized if asked) in chunk layout, in one pass over x: the per-token
        factor is laid out in chunks first, and an elementwise product takes its memory order from
        its first operand."""
        if use_qk_l2norm:  # as `l2_normalize`: x / sqrt(sum x^2 + eps)
            row = torch.rsqrt(_squared_norms(x) + L2NORM_EPS) * factor
        else:
            row = x.new_full((*x.shape[:-1], 1), factor)
        return (to_chunks(row).view(n_chunks, b, h, chunk, 1) * chunk_view(x)).flatten(1, 2)

    q, k = normalized_chunks(q, scale), normalized_chunks(k, 1.0)  # scale folds into q
    in_place = not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)))
    v, g, beta = to_chunks(v), to_chunks(g), to_chunks(beta).unsqueeze(-1)

    # H_i - r by one matmul; r - H_j is its negation (exact), so the matmul runs once. (Not
    # 1 / e^{H_i - r}: the reciprocal's gradient, -1 / x^2, overflows near the largest span.)
    exponents = _centering_matrix(chunk, dtype) @ g  # [N, BH, C, K]
    half = -exponents[..., :1, :]  # r - H_0 = r = H_last / 2
    to_half = torch.exp(exponents)  # e^{H_i - r}
    from_half = exponents.neg_().exp_()  # e^{r - H_j}, in place: exp's backward reads its result only
    first = g[..., :1, :]  # g_0 of each chunk
    # Here and below `_times` writes into its first operand when no gradient is recorded: each
    # such operand is a temporary of this function that nothing reads afterwards.
    q_to_half = _times(q, to_half, in_place)
    k_to_half = _times(to_half, k, in_place)  # after q's product: to_half is read no more
    k_from_half = _times(k, from_half, in_place)

    # M (scale is folded into q) and L (beta scales its rows). Above the diagonal both products
    # hold garbage that may overflow (e^{H_i - H_j} >= 1 there), so both are cut with tril, not
    # with a 0/1 product, and before beta multiplies L: beta's gradient sums over whole rows, and
    # 0 * inf would be NaN. (The unit lower-triangular solve never reads L's diagonal.)
    # (tril_ in place: a product's backward never reads the product itself.)
    m_scores = (q_to_half @ k_from_half.mT).tril_()
    lower = _times((k_to_half @ k_from_half.mT).tril_(-1), beta, in_place)
    eye = torch.eye(chunk, dtype=dtype)
    inverse = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)  # (I + L)^-1
    solve_beta = _times(inverse, beta.mT, in_place)  # (I + L)^-1 Diag(beta)

    # e^{G_i} = e^{g_0 + r} e^{H_i - r}: the per-channel e^{g_0 + r} commutes with (I + L)^-1.
    start = torch.exp(first + half)
    u = solve_beta @ v
    w = _times(solve_beta @ k_to_half, start, in_place)
    q_decayed = _times(q_to_half, start, in_place)  # scale q e^G
    k_to_end = _times(k_from_half, torch.exp(half), in_place).mT  # Kd^T: e^{G_last - G_j} = e^{r - H_j} e^{r}
    chunk_decay = torch.exp(first + 2 * half).mT  # e^{G_last} [N, BH, K, 1]

    return _ChunkTerms(u, w, m_scores, q_decayed, k_to_end, chunk_decay)


def _squared_norms(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) over the last dim, keepdim. vector_norm reduces a contiguous row fastest; on a
    strided last dim (the model's q and k: views of the short conv's [B, C, T] output) it goes
    element by element, where square().sum() keeps x's memory order (bench/kda_prefill_share.py)."""
    if x.stride(-1) == 1:
        return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    return x.square().sum(-1, keepdim=True)


def _times(x: torch.Tensor, factor: torch.Tensor, in_place: bool) -> torch.Tensor:
    """x * factor, written into x if `in_place` (no gradient recorded: one temporary less); under
    autograd a new tensor, since the product's backward reads x. The caller owns x and reads it
    no more."""
    return x.mul_(factor) if in_place else x * factor


def _state_pass(terms: _ChunkTerms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part: chunk by chunk, the deltas, outputs and next state from the state
    entering the chunk. Returns (o of each chunk [N, B*H, C, V]; state [B*H, K, V])."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*terms, state)):
        return _differentiable_state_pass(terms, state)
    return _state_pass_in_place(terms, state)


def _differentiable_state_pass(terms: _ChunkTerms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_state_pass` for autograd: a new tensor for every product (backward reads the states)."""
    u, w, m_scores, q_decayed, k_to_end, chunk_decay = terms
    outputs = []
    for n in range(u.shape[0]):
        delta = torch.baddbmm(u[n], w[n], state, alpha=-1)  # u = U - W S_0
        outputs.append(torch.baddbmm(m_scores[n] @ delta, q_decayed[n], state))
        state = torch.addcmul(k_to_end[n] @ delta, state, chunk_decay[n])
    return torch.stack(outputs), state


def _state_pass_in_place(terms: _ChunkTerms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_state_pass` without autograd: the same products written into buffers allocated once, and
    the state updated in place (in a copy: the caller's stays as it was)."""
    u, w, m_scores, q_decayed, k_to_end, chunk_decay = terms
    n_chunks, bh, chunk, dv = u.shape
    o = torch.empty_like(u)
    delta = u.new_empty(bh, chunk, dv)
    state = state.clone()
    for n in range(n_chunks):
        torch.baddbmm(u[n], w[n], state, alpha=-1, out=delta)  # u = U - W S_0
        torch.bmm(m_scores[n], delta, out=o[n]).baddbmm_(q_decayed[n], state)
        state.mul_(chunk_decay[n]).baddbmm_(k_to_end[n], delta)
    return o, state
