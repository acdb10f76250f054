"""Latent attention block (spec §4.3) with the optional DSA lightning indexer (§4.4).

Two equal forms of the same math: the expanded form (k_nope, v up-projected per head) for
prefill and training, and the absorbed form over the compressed latent cache for decode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.model.norm import RMSNorm
from deltamoe.ops.dsa import causal_topk, indexer_scores, topk_mask
from deltamoe.ops.mla import absorb_kv_b, mla_attention, mla_attention_absorbed_joined, mla_attention_absorbed_rows
from deltamoe.ops.rope import apply_rope, rope_cos_sin

# With a cache, new chunks of at most this many tokens use the absorbed form: it never expands
# the cached latents, which is what decode wants; long prefill chunks are cheaper expanded.
ABSORB_MAX_TOKENS = 16


class LightningIndexer(nn.Module):
    """DSA indexer: index queries from the MLA q latent, one LayerNorm-ed key per token, head weights."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.q_lora_rank is not None
        self.num_heads, self.head_dim = config.index_num_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.wq_b(q_latent).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        return q, k, self.weights_proj(x).float()


class LatentAttention(nn.Module):
    # DSA's selection is top_k wide at every context (`causal_topk(pad_to_top_k=True)`): the form
    # serve's compiled decode traces (`compiled_decode.decode_form`), one graph for every context.
    pads_topk = False

    def __init__(self, config: ModelConfig, layer_idx: int, use_dsa: bool):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h = config.hidden_size, config.num_attention_heads
        self.num_heads = h
        self.nope, self.rope, self.vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.mla_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.nope + self.vdim), bias=False)
        if config.mla_output_gate:
            self.g_proj = nn.Linear(d, h * self.vdim, bias=False)
        self.o_proj = nn.Linear(h * self.vdim, d, bias=False)
        self.indexer = LightningIndexer(config) if use_dsa else None
        self.scale = qk ** -0.5

    def forward(self, x: torch.Tensor, cache: ModelCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.num_heads
        past = cache.past_lengths if cache is not None else torch.zeros(b, dtype=torch.long, device=x.device)
        q_positions = past[:, None] + torch.arange(t, device=x.device)[None, :]
        new_lengths = cache.new_lengths if cache is not None else None
        kv_lengths = past + (t if new_lengths is None else new_lengths)  # padding is never a key

        q_latent, q_nope, q_pe = self.queries(x, q_positions)
        latent = self.latents(x, q_positions)
        absorbed = cache is not None and t <= ABSORB_MAX_TOKENS
        # DSA decode reads back only its top-k latent rows, after the indexer has chosen them.
        sparse_decode = absorbed and self.indexer is not None
        if sparse_decode:
            cache.store_latent(self.layer_idx, latent)
        elif cache is not None:
            latent = cache.append_latent(self.layer_idx, latent)
        latent_kv, k_pe_all = latent.split([self.kv_rank, self.rope], dim=-1)

        indices = valid = None
        if self.indexer is not None:
            q_idx, k_idx, w_idx = self.indexer(x, q_latent)
            if cache is not None:
                k_idx = cache.append_index_keys(self.layer_idx, k_idx)
            scores = indexer_scores(q_idx, k_idx, w_idx)
            indices, valid = causal_topk(scores, q_positions=q_positions, kv_lengths=kv_lengths,
                                         top_k=self.config.index_topk, pad_to_top_k=self.pads_topk)

        if absorbed:
            w = self.kv_b_proj.weight
            # Tensor parallel (parallel/tensor_parallel.py): a DTensor split by heads; absorb this rank's heads.
            w_uk, w_uv = absorb_kv_b(w.to_local() if isinstance(w, DTensor) else w, h, self.nope, self.vdim)
            if sparse_decode:
                rows = cache.latent_rows(self.layer_idx, indices.masked_fill(~valid, 0).reshape(b, -1))
                o = mla_attention_absorbed_rows(q_nope, q_pe, rows, w_uk, w_uv, scale=self.scale, valid=valid)
            else:
                o = mla_attention_absorbed_joined(q_nope, q_pe, latent, w_uk, w_uv, scale=self.scale,
                                                  q_positions=q_positions, kv_lengths=kv_lengths)
        else:
            s = latent_kv.shape[1]
            kv = self.kv_b_proj(latent_kv).reshape(b, s, h, self.nope + self.vdim)
            k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
            selected = topk_mask(indices, valid, s) if indices is not None else None
            o = mla_attention(q_nope, q_pe, k_nope, k_pe_all, v, scale=self.scale, q_positions=q_positions,
                              kv_lengths=kv_lengths, selected=selected)

        return self.output(o, x)

    # The pieces of `forward`, also used by the chained MTP training loss (model/mtp_chain.py).
    def queries(self, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x [B, T, D] at positions [B, T] -> (q latent or None, q_nope [B, T, H, Dn], q_pe [B, T, H, Dr] roped)."""
        b, t, _ = x.shape
        if self.config.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q_nope, q_pe = q.reshape(b, t, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        if self._uses_rope():
            cos, sin = rope_cos_sin(positions, self.rope, self.config.rope_theta)
            q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
        return q_latent, q_nope, q_pe

    def latents(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] at positions [B, T] -> the cached latent [B, T, R + Dr]: normed c_kv, roped k_pe."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        if self._uses_rope():
            cos, sin = rope_cos_sin(positions, self.rope, self.config.rope_theta)
            k_pe = apply_rope(k_pe, cos, sin)
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention output o [B, T, H, Dv] -> [B, T, D] (output gate from x, then o_proj)."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.num_heads * self.vdim)
        if self.config.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float()).to(o.dtype)
        return self.o_proj(o)

    def _uses_rope(self) -> bool:
        return not self.config.mla_use_nope and self.rope > 0

