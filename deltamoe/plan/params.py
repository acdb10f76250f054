"""Exact parameter counts per component, straight from a ModelConfig.

The planner needs parameters split the way deployments split them: routed experts (sharded
by EP, quantized to 4 bit in the native checkpoint) versus everything else (sharded by TP or
replicated, usually BF16), and total versus active per token. The formulas follow the
checkpoint tensor shapes of spec/kimi-family.md §5, so the K3 totals of §7 come out exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamoe.config import ModelConfig, VisionConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model; per-layer numbers are for one layer of that kind."""

    embedding: int
    lm_head: int
    kda_layer: int
    mla_layer: int
    dsa_indexer: int  # extra parameters of one DSA layer on top of its MLA
    dense_mlp: int
    expert: int  # one routed expert
    router: int  # gate weight + correction bias
    latent_proj: int  # down/up projections + norm of latent MoE (0 without latent MoE)
    shared_experts: int
    norms: int  # every RMSNorm and AttnRes vector, all layers plus the final ones
    vision_tower: int
    projector: int
    tied_embeddings: bool
    n_kda: int
    n_mla: int  # full-attention layers, DSA included
    n_dsa: int
    n_dense: int
    n_moe: int
    num_experts: int
    top_k: int

    # ------------------------------------------------------------- groups
    @property
    def routed(self) -> int:
        return self.n_moe * self.num_experts * self.expert

    @property
    def attention(self) -> int:
        return self.n_kda * self.kda_layer + self.n_mla * self.mla_layer + self.n_dsa * self.dsa_indexer

    @property
    def moe_dense_part(self) -> int:
        """Per-model MoE parameters that every token uses: router, latent projections, shared expert."""
        return self.n_moe * (self.router + self.latent_proj + self.shared_experts)

    @property
    def text_total(self) -> int:
        head = 0 if self.tied_embeddings else self.lm_head
        return (self.embedding + head + self.attention + self.n_dense * self.dense_mlp
                + self.moe_dense_part + self.routed + self.norms)

    @property
    def vision(self) -> int:
        return self.vision_tower + self.projector

    @property
    def total(self) -> int:
        return self.text_total + self.vision

    @property
    def non_routed(self) -> int:
        """Everything but the routed experts, vision included (kept in BF16 by the native checkpoint)."""
        return self.total - self.routed

    @property
    def routed_active(self) -> int:
        """Routed expert parameters one token touches: top_k of num_experts in each MoE layer."""
        return self.n_moe * self.top_k * self.expert

    @property
    def active(self) -> int:
        """Active text parameters per token: non-embedding active + lm_head (spec §7 convention)."""
        non_embedding = (self.attention + self.n_dense * self.dense_mlp + self.moe_dense_part
                         + self.routed_active + self.norms)
        return non_embedding + self.lm_head

    def per_layer_attention(self, layer_type: str) -> int:
        if layer_type == "kda":
            return self.kda_layer
        return self.mla_layer + (self.dsa_indexer if layer_type == "dsa" else 0)


def kda_layer_params(cfg: ModelConfig) -> int:
    d, h, hd, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    p = h * hd
    qkv = 3 * d * p
    out = p * d
    decay = d * hd + hd * p + p  # low-rank f_a/f_b projections + dt_bias
    beta = d * h
    conv = 3 * p * k
    a_log = h  # stored padded to 128 in K3; only the first H are real parameters
    o_norm = hd
    gate = d * p if cfg.kda_output_gate == "full_rank" else d * hd + hd * p
    return qkv + out + decay + beta + conv + a_log + o_norm + gate


def mla_layer_params(cfg: ModelConfig) -> int:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    else:
        q = d * h * cfg.qk_head_dim
    kv = (d * cfg.latent_cache_dim + cfg.kv_lora_rank
          + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    out = h * cfg.v_head_dim * d
    gate = d * h * cfg.v_head_dim if cfg.mla_output_gate else 0
    return q + kv + out + gate


def dsa_indexer_params(cfg: ModelConfig) -> int:
    """wq_b (q latent -> heads x dim), wk, LayerNorm weight+bias, weights_proj (spec §4.4)."""
    q_in = cfg.q_lora_rank or cfg.hidden_size
    return (q_in * cfg.index_num_heads * cfg.index_head_dim + cfg.hidden_size * cfg.index_head_dim
            + 2 * cfg.index_head_dim + cfg.hidden_size * cfg.index_num_heads)


def vision_params(v: VisionConfig | None, hidden_size: int) -> tuple[int, int]:
    """(tower, projector). The tower has no biases; the projector is Linear-GELU-Linear-RMSNorm."""
    if v is None:
        return 0, 0
    width = v.num_attention_heads * v.head_dim
    block = v.hidden_size * 3 * width + width * v.hidden_size + 2 * v.hidden_size * v.intermediate_size
    block += 2 * v.hidden_size  # two norms
    patch = v.hidden_size * v.in_channels * v.patch_size * v.patch_size
    pos = v.pos_emb_height * v.pos_emb_width * v.hidden_size
    tower = v.num_hidden_layers * block + v.hidden_size + patch + pos
    pin = v.projector_in
    projector = pin * pin + hidden_size * pin + hidden_size
    return tower, projector


def count_params(cfg: ModelConfig) -> ParamCounts:
    d = cfg.hidden_size
    types = cfg.layer_types
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    ew = cfg.expert_dim
    latent = 2 * d * cfg.latent_moe_size + (cfg.latent_moe_size if cfg.latent_moe_norm else 0) \
        if cfg.latent_moe_size else 0
    # Block AttnRes adds a norm and a projection vector per mixer (spec §4.1): 6 vectors per layer
    # and three at the output; a plain pre-norm residual has two per layer and the final norm.
    per_layer_norms, final_norms = (6, 3) if cfg.attn_res_block_size else (2, 1)
    tower, projector = vision_params(cfg.vision, d)
    emb = cfg.vocab_size * d
    return ParamCounts(
        embedding=emb,
        lm_head=emb,  # a tied head adds no bytes but still costs its matmul
        kda_layer=kda_layer_params(cfg),
        mla_layer=mla_layer_params(cfg),
        dsa_indexer=dsa_indexer_params(cfg),
        dense_mlp=3 * d * cfg.intermediate_size,
        expert=3 * ew * cfg.moe_intermediate_size,
        router=cfg.num_experts * d + (cfg.num_experts if cfg.moe_router_bias else 0),
        latent_proj=latent,
        shared_experts=3 * d * cfg.shared_expert_size,
        norms=per_layer_norms * d * cfg.num_hidden_layers + final_norms * d,
        vision_tower=tower,
        projector=projector,
        tied_embeddings=cfg.tie_word_embeddings,
        n_kda=types.count("kda"),
        n_mla=types.count("mla") + types.count("dsa"),
        n_dsa=types.count("dsa"),
        n_dense=cfg.num_hidden_layers - n_moe,
        n_moe=n_moe,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_token,
    )
