"""DSA: indexer scores, causal top-k, and sparse attention against dense and transformers."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops.dsa import causal_topk, indexer_scores, selects_every_key, topk_mask
from deltamoe.ops.mla import (
    absorb_kv_b,
    mla_attention,
    mla_attention_absorbed_joined,
    mla_attention_absorbed_rows,
    visible_keys,
)
from deltamoe.serve.engine.compiled_decode import compiler_available

B, H, NOPE, ROPE, VDIM, RANK = 2, 3, 16, 8, 16, 12

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="torch.compile needs a C++ compiler")


def test_indexer_scores_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, 5, 4, 8, generator=gen), torch.randn(B, 7, 8, generator=gen)
    w = torch.randn(B, 5, 4, generator=gen)
    scores = indexer_scores(q, k, w)
    assert scores.shape == (B, 5, 7) and scores.dtype == torch.float32
    b, t, s = 1, 3, 6
    expected = sum(w[b, t, h] * torch.relu(q[b, t, h] @ k[b, s]) for h in range(4))
    assert scores[b, t, s].item() == pytest.approx(expected.item(), rel=1e-5)
    assert indexer_scores(q.bfloat16(), k.bfloat16(), w).dtype == torch.float32
    with pytest.raises(ValueError, match=r"k_index: expected shape \[B, S, Di\]"):
        indexer_scores(q, k[..., :4], w)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, k, w[..., :3])



@pytest.mark.parametrize("seed", range(4))
def test_indexer_scores_equal_the_einsum_reference(seed: int) -> None:
    """Key-major fast path vs the readable einsums, decode (T = 1) and prefill shapes."""
    from deltamoe.ops.dsa import indexer_scores_reference

    gen = torch.Generator().manual_seed(seed)
    b, t, s, hi, di = [(2, 1, 300, 4, 16), (3, 7, 40, 8, 8), (1, 1, 1, 2, 4), (2, 5, 9, 3, 32)][seed]
    q, k, w = torch.randn(b, t, hi, di, generator=gen), torch.randn(b, s, di, generator=gen), torch.randn(b, t, hi, generator=gen)
    torch.testing.assert_close(indexer_scores(q, k, w), indexer_scores_reference(q, k, w), rtol=1e-5, atol=1e-5)

def test_causal_topk_selects_best_visible_keys() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(B, 6, 10, generator=gen)
    q_positions = torch.tensor([[4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, -1]])
    kv_lengths = torch.tensor([10, 3])
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=4)
    assert indices.shape == valid.shape == (B, 6, 4) and indices.dtype == torch.long
    visible = visible_keys(q_positions, kv_lengths, 10)
    # Row 1 sees 1, 2, 3, 3, 3 keys (length 3 caps it) and the padded query (-1) sees none.
    assert valid.sum(-1).tolist() == [[4, 4, 4, 4, 4, 4], [1, 2, 3, 3, 3, 0]]
    for b in range(B):
        for t in range(6):
            chosen = indices[b, t][valid[b, t]]
            assert visible[b, t, chosen].all() and len(set(chosen.tolist())) == len(chosen)
            rest = visible[b, t].clone()
            rest[chosen] = False
            if rest.any():  # every selected key scores at least as high as every unselected visible one
                assert scores[b, t, chosen].min() >= scores[b, t][rest].max()
            assert (scores[b, t, chosen].diff() <= 0).all()  # descending order
    assert (indices[~valid] == 0).all()
    # K = min(top_k, S)
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=50)
    assert indices.shape == (B, 6, 10) and torch.equal(topk_mask(indices, valid, 10), visible)


def test_causal_topk_ties_are_deterministic() -> None:
    """Equal scores (common: relu zeroes every head) resolve to the lower slot; -inf stays selectable."""
    scores = torch.zeros(1, 2, 8)
    scores[0, 1, 5] = 1.0
    scores[0, 1, 2] = float("-inf")
    q_positions, kv_lengths = torch.tensor([[7, 7]]), torch.tensor([8])
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=3)
    assert indices.tolist() == [[[0, 1, 2], [5, 0, 1]]] and valid.all()
    indices, valid = causal_topk(scores, q_positions=torch.tensor([[2, 2]]), kv_lengths=kv_lengths, top_k=3)
    assert indices[0, 1].tolist() == [0, 1, 2] and valid.all()  # a visible -inf key is still a key


@pytest.mark.parametrize("seed", range(6))
def test_causal_topk_equals_the_full_sort_reference(seed: int) -> None:
    """O(S) selection vs one stable sort: integer scores make many ties at the threshold, rows see
    fewer keys than K, more than K, or none; some visible scores are -inf."""
    from deltamoe.ops.dsa import causal_topk_reference

    g = torch.Generator().manual_seed(seed)
    b, t, s, k = 3, 4, 40, 9
    scores = torch.randint(-3, 4, (b, t, s), generator=g).float()
    scores[0, 0, :5] = float("-inf")
    past = torch.tensor([0, 3, 30])
    q_positions = past[:, None] + torch.arange(t)
    kv_lengths = torch.tensor([2, 7, 34])
    got = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
    want = causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    empty = causal_topk(scores[:, :, :0], q_positions=q_positions, kv_lengths=kv_lengths * 0, top_k=k)
    assert empty[0].shape == (b, t, 0)




@pytest.mark.parametrize("seed", range(4))
def test_causal_topk_equals_the_reference_on_continuous_scores(seed: int) -> None:
    """Random scores: rows that see more keys than K, fewer, none (a padding query at position
    -1), and a decode row; fp32 and bf16 scores."""
    from deltamoe.ops import dsa

    g = torch.Generator().manual_seed(seed)
    b, t, s, k = 3, 5, 300, 16
    q_positions = torch.tensor([[0, 1, 2, 3, -1], [100, 101, 102, 103, 104], [295, 296, 297, 298, 299]])
    kv_lengths = torch.tensor([4, 105, 300])
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(b, t, s, generator=g).to(dtype)
        got = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
        want = dsa.causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_causal_topk_orders_signed_zeros_extremes_and_subnormals_like_the_reference() -> None:
    """The selection keys reinterpret float bits: -0.0 must tie with +0.0 (lower slot first),
    subnormals and the largest finite values of both signs keep their order, a visible -inf ties
    with the lowest finite score (the reference clamps it there) and ranks above hidden keys."""
    from deltamoe.ops import dsa

    tiny = torch.finfo(torch.float32).tiny / 4  # a subnormal
    big = torch.finfo(torch.float32).max
    row = [0.0, -0.0, tiny, -tiny, big, -big, float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0, -big, tiny]
    scores = torch.tensor(row).repeat(2, 1).reshape(1, 2, -1)
    s = scores.shape[-1]
    q_positions = torch.tensor([[s - 1, s - 3]])  # the second row hides its last two keys
    kv_lengths = torch.tensor([s])
    for k in (1, 5, 9, s):
        got = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
        want = dsa.causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), k
    got = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=s)[0][0, 0].tolist()
    assert got[:3] == [6, 4, 10] and got[-3:] == [5, 7, 12]  # +inf, max, 1 ... then -max, -inf, -max by slot
    assert got.index(0) < got.index(1) < got.index(8) < got.index(9)  # the four zeros, by slot


@needs_compiler
def test_causal_topk_compiles_to_one_graph_with_the_same_selection() -> None:
    """One graph with no host read: integer scores (ties at the threshold everywhere) still give
    the full sort's selection."""
    from deltamoe.ops.dsa import causal_topk_reference

    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (2, 3, 30), generator=g).float()
    q_positions = torch.tensor([[10, 11, 12], [27, 28, 29]])
    kv_lengths = torch.tensor([13, 30])
    compiled = torch.compile(causal_topk, fullgraph=True, dynamic=False)
    got = compiled(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=6)
    want = causal_topk_reference(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("num_keys", [3, 5, 6, 9])
def test_selects_every_key_gives_causal_topks_width(num_keys: int) -> None:
    """Under top_k keys every key is kept and the output is num_keys wide; from top_k on it is top_k wide."""
    scores = torch.randn(1, 2, num_keys, generator=torch.Generator().manual_seed(num_keys))
    indices, valid = causal_topk(scores, q_positions=torch.tensor([[num_keys - 2, num_keys - 1]]),
                                 kv_lengths=torch.tensor([num_keys]), top_k=6)
    assert selects_every_key(num_keys, 6) == (num_keys < 6)
    assert indices.shape[-1] == valid.shape[-1] == (num_keys if selects_every_key(num_keys, 6) else 6)


@pytest.mark.parametrize("num_keys", [3, 6, 9, 40])
def test_causal_topk_padded_to_top_k_is_the_same_selection_top_k_wide(num_keys: int) -> None:
    """The padded form (compiled decode's) keeps the unpadded entries and adds only invalid slot-0
    ones, under and over top_k keys, with tied and -inf scores and a row that sees no key."""
    g = torch.Generator().manual_seed(num_keys)
    scores = torch.randint(-2, 3, (3, 2, num_keys), generator=g).float()
    scores[1, 0, :2] = float("-inf")
    q_positions = torch.tensor([[num_keys - 2, num_keys - 1], [0, 1], [-1, -1]]).clamp(min=0)
    kv_lengths = torch.tensor([num_keys, 2, 0])
    want = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=6)
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=6, pad_to_top_k=True)
    assert indices.shape == valid.shape == (3, 2, 6)
    top = want[0].shape[-1]
    assert torch.equal(indices[..., :top], want[0]) and torch.equal(valid[..., :top], want[1])
    assert not valid[..., top:].any() and not indices[..., top:].any()
    assert not valid[2].any()


def test_causal_topk_shapes_do_not_depend_on_data() -> None:
    """Pipeline stages infer output shapes with meta tensors; the selection must not use
    data-dependent shapes (nonzero), or the stage sees [B,T,0] and the whole job fails."""
    scores = torch.empty(2, 12, 40, device="meta")
    q_positions = torch.empty(2, 12, dtype=torch.long, device="meta")
    kv_lengths = torch.empty(2, dtype=torch.long, device="meta")
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=5)
    assert indices.shape == (2, 12, 5) and valid.shape == (2, 12, 5)

def test_topk_mask_ignores_invalid_entries() -> None:
    indices = torch.tensor([[[3, 0, 0], [0, 2, 1]]])
    valid = torch.tensor([[[True, True, False], [True, False, False]]])
    mask = topk_mask(indices, valid, 4)
    assert mask.tolist() == [[[True, False, False, True], [True, False, False, False]]]


def mla_inputs(gen: torch.Generator, time: int, keys: int) -> dict[str, torch.Tensor]:
    latent = torch.randn(B, keys, RANK, generator=gen)
    kv_b = torch.randn(H * (NOPE + VDIM), RANK, generator=gen) / RANK**0.5
    k_nope, v = (latent @ kv_b.T).view(B, keys, H, NOPE + VDIM).split([NOPE, VDIM], dim=-1)
    return {"q_nope": torch.randn(B, time, H, NOPE, generator=gen),
            "q_pe": torch.randn(B, time, H, ROPE, generator=gen),
            "latent": latent, "k_pe": torch.randn(B, keys, ROPE, generator=gen),
            "kv_b": kv_b, "k_nope": k_nope, "v": v}


def selected_rows(x: dict[str, torch.Tensor], indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The cached [latent | k_pe] rows at each query's selected slots, as `latent_rows` reads them."""
    rows = torch.cat((x["latent"], x["k_pe"]), dim=-1)
    slots = indices.masked_fill(~valid, 0).reshape(B, -1)
    return rows.gather(1, slots[..., None].expand(-1, -1, rows.shape[-1]))


@pytest.mark.parametrize("kind", ["random", "constant", "with_inf"])
def test_dsa_equals_dense_when_every_key_fits(kind: str) -> None:
    """T <= top_k: every visible key is selected, whatever the scores, so DSA is dense MLA exactly."""
    time, top_k = 9, 9
    gen = torch.Generator().manual_seed(2)
    x = mla_inputs(gen, time, time)
    scores = torch.randn(B, time, time, generator=gen)
    if kind == "constant":
        scores = torch.zeros(B, time, time)
    elif kind == "with_inf":
        scores = scores.masked_fill(torch.rand(B, time, time, generator=gen) < 0.3, float("-inf"))
    q_positions, kv_lengths = torch.arange(time).expand(B, time), torch.tensor([9, 6])
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=top_k)
    kwargs = dict(scale=(NOPE + ROPE) ** -0.5, q_positions=q_positions, kv_lengths=kv_lengths)
    dense = mla_attention(x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], **kwargs)
    sparse = mla_attention(x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"],
                           selected=topk_mask(indices, valid, time), **kwargs)
    assert torch.equal(sparse, dense)
    # The gathered decode form agrees too (different summation order, so to fp32 precision).
    w_uk, w_uv = absorb_kv_b(x["kv_b"], H, NOPE, VDIM)
    gathered = mla_attention_absorbed_rows(x["q_nope"], x["q_pe"], selected_rows(x, indices, valid), w_uk, w_uv,
                                           scale=kwargs["scale"], valid=valid)
    torch.testing.assert_close(gathered, dense, rtol=1e-5, atol=1e-5)


def test_dsa_limits_attention_beyond_top_k() -> None:
    """T > top_k: attention is a softmax over exactly the indexer's top-k keys, built by hand."""
    time, top_k, index_heads, index_dim = 13, 4, 3, 8
    gen = torch.Generator().manual_seed(3)
    x = mla_inputs(gen, time, time)
    scores = indexer_scores(torch.randn(B, time, index_heads, index_dim, generator=gen),
                            torch.randn(B, time, index_dim, generator=gen),
                            torch.randn(B, time, index_heads, generator=gen))
    q_positions, kv_lengths = torch.arange(time).expand(B, time), torch.tensor([13, 10])
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=top_k)
    scale = (NOPE + ROPE) ** -0.5
    kwargs = dict(scale=scale, q_positions=q_positions, kv_lengths=kv_lengths)
    selected = topk_mask(indices, valid, time)
    out = mla_attention(x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], selected=selected, **kwargs)
    dense = mla_attention(x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], **kwargs)
    expected = torch.empty_like(out)
    for b in range(B):
        for t in range(time):
            keep = sorted(indices[b, t][valid[b, t]].tolist())
            assert len(keep) == min(top_k, min(t + 1, int(kv_lengths[b])))
            for h in range(H):
                logits = x["k_nope"][b, keep, h] @ x["q_nope"][b, t, h] + x["k_pe"][b, keep] @ x["q_pe"][b, t, h]
                logits = logits * scale
                expected[b, t, h] = torch.softmax(logits, dim=0) @ x["v"][b, keep, h]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    late = q_positions[0] >= top_k  # queries that see more keys than top_k really differ from dense
    assert (out[0, late] - dense[0, late]).abs().amax() > 1e-2
    torch.testing.assert_close(out[0, ~late], dense[0, ~late], rtol=0, atol=0)
    # The decode forms over the latent cache agree with the masked prefill form.
    w_uk, w_uv = absorb_kv_b(x["kv_b"], H, NOPE, VDIM)
    joined = torch.cat((x["latent"], x["k_pe"]), dim=-1)
    absorbed = mla_attention_absorbed_joined(x["q_nope"], x["q_pe"], joined, w_uk, w_uv, selected=selected, **kwargs)
    torch.testing.assert_close(absorbed, out, rtol=1e-5, atol=1e-5)
    rows = mla_attention_absorbed_rows(x["q_nope"], x["q_pe"], selected_rows(x, indices, valid), w_uk, w_uv,
                                       scale=scale, valid=valid)
    torch.testing.assert_close(rows, out, rtol=1e-5, atol=1e-5)


# --- transformers oracle: DeepseekV32Indexer with rotary off (cos = 1, sin = 0) ---------------

INDEX_HEADS, INDEX_DIM, HIDDEN, Q_LORA, TOP_K = 8, 16, 32, 24, 5


@pytest.fixture(scope="module")
def hf_indexer():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    config = DeepseekV32Config(hidden_size=HIDDEN, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=Q_LORA,
                               kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM,
                               index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOP_K,
                               num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(4)
    indexer = DeepseekV32Indexer(config, 0).eval()
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: give k_norm real parameters
        indexer.k_norm.weight.normal_(1.0, 0.2)
        indexer.k_norm.bias.normal_(0.0, 0.2)
    return config, indexer


def our_scores(indexer, hidden: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
    """The deltamoe side: same weights, q/k/w computed as our layer does, constants folded into w."""
    batch, time, _ = hidden.shape
    with torch.no_grad():
        q = indexer.wq_b(q_latent).view(batch, time, INDEX_HEADS, INDEX_DIM)
        k = indexer.k_norm(indexer.wk(hidden))
        w = indexer.weights_proj(hidden) * INDEX_HEADS**-0.5 * INDEX_DIM**-0.5
    return indexer_scores(q, k, w)


def assert_same_selection(hf_indices, indices, valid, visible, scores) -> None:
    """Equal sets per query, up to exact ties at the boundary (relu makes score 0 common).

    transformers' top-k also returns masked (-inf) slots when a query sees fewer than top_k
    keys, so its set is restricted to visible slots first.
    """
    batch, time, _ = indices.shape
    for b in range(batch):
        for t in range(time):
            theirs = [s for s in hf_indices[b, t].tolist() if visible[b, t, s]]
            ours = indices[b, t][valid[b, t]].tolist()
            assert len(ours) == len(theirs) == min(TOP_K, int(visible[b, t].sum()))
            if set(ours) != set(theirs):
                torch.testing.assert_close(scores[b, t, sorted(ours)].sort().values,
                                           scores[b, t, sorted(theirs)].sort().values)


def test_topk_matches_transformers_indexer_prefill(hf_indexer) -> None:
    from transformers.masking_utils import create_causal_mask

    config, indexer = hf_indexer
    time = 17
    gen = torch.Generator().manual_seed(5)
    hidden, q_latent = torch.randn(B, time, HIDDEN, generator=gen), torch.randn(B, time, Q_LORA, generator=gen)
    kv_lengths = torch.tensor([17, 11])
    padding = (torch.arange(time) < kv_lengths[:, None]).long()  # row 1 right-padded
    q_positions = torch.arange(time).expand(B, time)
    mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=padding, past_key_values=None,
                              position_ids=q_positions, allow_is_causal_skip=False)
    no_rope = (torch.ones(B, time, ROPE), torch.zeros(B, time, ROPE))
    hf_indices = indexer(hidden, q_latent, no_rope, mask[:, 0], q_positions).long()

    scores = our_scores(indexer, hidden, q_latent)
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=TOP_K)
    visible = visible_keys(q_positions, kv_lengths, time)
    assert torch.equal(mask[:, 0], visible)  # the same causality + padding rule
    assert_same_selection(hf_indices, indices, valid, visible, scores)


def test_topk_matches_transformers_indexer_decode(hf_indexer) -> None:
    """Prefill into transformers' indexer-key cache, then one decode token per row at position past_len."""
    from transformers.cache_utils import DynamicCache

    config, indexer = hf_indexer
    past, time = 12, 13
    gen = torch.Generator().manual_seed(6)
    hidden, q_latent = torch.randn(B, time, HIDDEN, generator=gen), torch.randn(B, time, Q_LORA, generator=gen)
    kv_lengths = torch.tensor([13, 9])  # row 1: 8 real prompt tokens, then padding, then its decode slot
    visible_all = visible_keys(torch.arange(time).expand(B, time), kv_lengths, time)
    cache = DynamicCache(config=config)
    ones, zeros = torch.ones(B, time, ROPE), torch.zeros(B, time, ROPE)
    positions = torch.arange(time).expand(B, time)
    indexer(hidden[:, :past], q_latent[:, :past], (ones[:, :past], zeros[:, :past]), visible_all[:, :past, :past],
            positions[:, :past], past_key_values=cache)
    q_positions = torch.full((B, 1), past)
    visible = visible_keys(q_positions, kv_lengths, time)
    hf_indices = indexer(hidden[:, past:], q_latent[:, past:], (ones[:, past:], zeros[:, past:]), visible,
                         q_positions, past_key_values=cache).long()

    scores = our_scores(indexer, hidden, q_latent)[:, past:]  # the decode query against all cached keys
    indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths, top_k=TOP_K)
    assert_same_selection(hf_indices, indices, valid, visible, scores)


def test_bad_inputs_raise() -> None:
    scores = torch.zeros(B, 3, 5)
    with pytest.raises(ValueError, match="top_k"):
        causal_topk(scores, q_positions=torch.zeros(B, 3, dtype=torch.long), kv_lengths=torch.tensor([5, 5]), top_k=0)
    with pytest.raises(ValueError, match=r"q_positions: expected shape \[B, T\]"):
        causal_topk(scores, q_positions=torch.zeros(B, 4, dtype=torch.long), kv_lengths=torch.tensor([5, 5]), top_k=2)
    with pytest.raises(ValueError, match="kv_lengths"):
        causal_topk(scores, q_positions=torch.zeros(B, 3, dtype=torch.long), kv_lengths=torch.tensor([5]), top_k=2)
