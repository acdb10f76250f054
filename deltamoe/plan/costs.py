"""Bytes and FLOPs of one model: weights per component, caches per token and per sequence,
MoE all-to-all traffic per token, and FLOPs per token for prefill and decode.

Formulas: spec/hardware-and-recipes.md §3. What hybrid-unaware calculators get wrong and this
file gets right: only full-attention layers hold a per-token cache (576 latent values, plus
DSA indexer keys), KDA layers hold a fixed recurrent + conv state per sequence, and latent
MoE sends tokens at the latent width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from deltamoe.config import ModelConfig
from deltamoe.plan.params import ParamCounts, count_params
from deltamoe.plan.precision import CacheFormat, WeightScheme, kv_format, weight_scheme

FP32 = 4
BF16 = 2
KDA_CHUNK = 64  # chunkwise KDA prefill block (fla / vLLM default)


@dataclass(frozen=True)
class WeightBytes:
    """Bytes per component under one weight scheme."""

    routed: float
    attention: float
    dense_mlp: float
    moe_shared: float  # router + latent projections + shared experts
    embedding: float
    lm_head: float
    norms: float
    vision: float

    @property
    def non_routed(self) -> float:
        return self.total - self.routed

    @property
    def total(self) -> float:
        return (self.routed + self.attention + self.dense_mlp + self.moe_shared + self.embedding
                + self.lm_head + self.norms + self.vision)

    def as_dict(self) -> dict[str, float]:
        return {"routed_experts": self.routed, "attention": self.attention, "dense_mlp": self.dense_mlp,
                "moe_router_latent_shared": self.moe_shared, "embedding": self.embedding,
                "lm_head": self.lm_head, "norms": self.norms, "vision": self.vision, "total": self.total}


@dataclass(frozen=True)
class ModelCosts:
    cfg: ModelConfig
    scheme: WeightScheme
    kv: CacheFormat
    kda_state_bytes: int = FP32  # vLLM default fp32; SGLang --mamba-ssm-dtype bfloat16 halves it
    draft_tokens: int = 0  # speculative tokens verified per step (widen the conv state)

    @cached_property
    def params(self) -> ParamCounts:
        return count_params(self.cfg)

    # ------------------------------------------------------------- weights
    @cached_property
    def weights(self) -> WeightBytes:
        p, s = self.params, self.scheme
        router = p.n_moe * p.router
        return WeightBytes(
            routed=p.routed * s.routed.bytes_per_param,
            attention=p.attention * s.dense.bytes_per_param,
            dense_mlp=p.n_dense * p.dense_mlp * s.dense.bytes_per_param,
            moe_shared=(p.moe_dense_part - router) * s.dense.bytes_per_param + router * s.embedding.bytes_per_param,
            embedding=p.embedding * s.embedding.bytes_per_param,
            lm_head=(0 if p.tied_embeddings else p.lm_head) * s.embedding.bytes_per_param,
            norms=p.norms * s.embedding.bytes_per_param,
            vision=p.vision * s.embedding.bytes_per_param,
        )

    @property
    def expert_bytes(self) -> float:
        return self.params.expert * self.scheme.routed.bytes_per_param

    def weights_per_chip(self, tp: int, ep: int, pp: int, redundant_experts: int = 0) -> float:
        """Routed experts split over EP, the rest over TP, both over PP stages.

        Embedding and lm_head are vocabulary-parallel over TP; norms are replicated. Vision runs
        once per request, so its tower sits TP-split on every rank that may serve an image.
        """
        w, p = self.weights, self.params
        experts_per_chip = (p.num_experts + redundant_experts) / ep
        routed = experts_per_chip * self.expert_bytes * p.n_moe / pp
        layered = (w.attention + w.dense_mlp + w.moe_shared) / (tp * pp)
        return routed + layered + (w.embedding + w.lm_head + w.vision) / tp + w.norms

    # -------------------------------------------------------------- caches
    @property
    def mla_bytes_per_token_layer(self) -> float:
        """Latent KV: kv_lora_rank + rope dims (576 for K3 and DeepSeek-V3)."""
        return self.cfg.latent_cache_dim * self.kv.mla_bytes

    @property
    def indexer_bytes_per_token_layer(self) -> float:
        """One DSA key shared by all index heads, plus an fp32 scale per 128 dims when FP8."""
        d = self.cfg.index_head_dim
        return d * self.kv.indexer_key_bytes_per_dim + -(-d // 128) * self.kv.indexer_scale_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        p = self.params
        return p.n_mla * self.mla_bytes_per_token_layer + p.n_dsa * self.indexer_bytes_per_token_layer

    @property
    def kda_recurrent_bytes_per_layer(self) -> float:
        c = self.cfg
        return c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * self.kda_state_bytes

    @property
    def kda_conv_bytes_per_layer(self) -> float:
        """q, k and v conv windows: the last K-1 (+ speculative) inputs per channel, model dtype."""
        c = self.cfg
        return 3 * c.kda_dim * (c.kda_conv_size - 1 + self.draft_tokens) * BF16

    @property
    def kda_state_bytes_per_seq(self) -> float:
        return self.params.n_kda * (self.kda_recurrent_bytes_per_layer + self.kda_conv_bytes_per_layer)

    def seq_cache_bytes(self, context: int) -> float:
        """Cache of one sequence at `context` tokens: grows with MLA/DSA, fixed for KDA."""
        return context * self.kv_bytes_per_token + self.kda_state_bytes_per_seq

    def decode_cache_read_bytes(self, context: int) -> float:
        """Cache bytes one decode token reads: DSA layers read top-k latent rows plus all indexer
        keys; MLA layers read every row; KDA reads and writes its state."""
        p, c = self.params, self.cfg
        sel = min(context, c.index_topk)
        mla = (p.n_mla - p.n_dsa) * context * self.mla_bytes_per_token_layer
        dsa = p.n_dsa * (sel * self.mla_bytes_per_token_layer + context * self.indexer_bytes_per_token_layer)
        return mla + dsa + 2 * self.kda_state_bytes_per_seq

    # ------------------------------------------------------ all-to-all
    def a2a_bytes_per_copy(self, fp8_dispatch: bool) -> tuple[float, float]:
        """(dispatch, combine) bytes of one token copy sent to one expert rank.

        Dispatch goes at the expert width (latent width for latent MoE) in FP8 with an fp32 scale
        per 128 (DeepEP) when the chip has FP8, else BF16; combine returns BF16.
        """
        w = self.cfg.expert_dim
        dispatch = w + -(-w // 128) * FP32 if fp8_dispatch else w * BF16
        return float(dispatch), float(w * BF16)

    def a2a_bytes_per_token_layer(self, fp8_dispatch: bool = True) -> float:
        d, c = self.a2a_bytes_per_copy(fp8_dispatch)
        return self.cfg.num_experts_per_token * (d + c)

    # ------------------------------------------------------------ FLOPs
    @property
    def linear_flops_per_token(self) -> tuple[float, float]:
        """(routed, rest) matmul FLOPs of one token: 2 per active parameter, lm_head included."""
        p = self.params
        return 2.0 * p.routed_active, 2.0 * (p.active - p.routed_active)

    def attention_flops_decode(self, context: int) -> float:
        """Per decoded token: absorbed MLA over the context (top-k rows for DSA), the indexer scan,
        and the KDA state update + readout, which does not grow with context."""
        c, p = self.cfg, self.params
        per_row = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
        sel = min(context, c.index_topk)
        mla = (p.n_mla - p.n_dsa) * per_row * context + p.n_dsa * per_row * sel
        indexer = p.n_dsa * 2 * c.index_num_heads * c.index_head_dim * context
        kda = p.n_kda * 4 * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim
        return float(mla + indexer + kda)

    def attention_flops_prefill(self, context: int) -> float:
        """Per prompt token, averaged over a causal prompt of `context` tokens (spec §3.7)."""
        c, p = self.cfg, self.params
        width = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
        dense_keys = context / 2  # mean causal keys per query
        k = c.index_topk
        sparse_keys = dense_keys if context <= k else (k * k / 2 + k * (context - k)) / context
        mla = 2 * width * ((p.n_mla - p.n_dsa) * dense_keys + p.n_dsa * sparse_keys)
        indexer = p.n_dsa * 2 * c.index_num_heads * c.index_head_dim * dense_keys
        h, d = c.kda_num_heads, c.kda_head_dim
        kda = p.n_kda * (4 * h * d * d + 2 * h * KDA_CHUNK * (d + d))
        return float(mla + indexer + kda)

    # ---------------------------------------------------------- memory
    def prefill_activation_bytes(self, tokens: int, tp: int) -> float:
        """Peak live activations of a prefill chunk on one chip (BF16): a few residual-width
        tensors (AttnRes keeps a bank of block sums), the widest TP-split projection, and the
        MoE dispatch/combine buffers at expert width."""
        c = self.cfg
        bank = (c.num_hidden_layers // c.attn_res_block_size + 2) if c.attn_res_block_size else 2
        widest = max(4 * c.kda_dim, c.num_attention_heads * (c.qk_head_dim + c.qk_nope_head_dim + c.v_head_dim),
                     2 * c.intermediate_size, 2 * c.shared_expert_size)
        moe = 2 * c.num_experts_per_token * c.expert_dim / tp
        return tokens * BF16 * ((bank + 4) * c.hidden_size + widest / tp + moe)


def model_costs(cfg: ModelConfig, weights: str = "bf16", kv_cache: str = "bf16", kda_state_bytes: int = FP32,
                draft_tokens: int = 0) -> ModelCosts:
    return ModelCosts(cfg, weight_scheme(weights), kv_format(kv_cache), kda_state_bytes, draft_tokens)
