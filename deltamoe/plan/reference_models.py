"""Non-Kimi-hybrid models the validation needs: DeepSeek-V3 and Kimi K2.

Both are all-MLA MoE models, so they fit ModelConfig as `kimi_linear` with every layer "mla",
RoPE on (`mla_use_nope=False`), no output gate, no latent MoE, plain residual. They live here,
not in presets, because deltamoe cannot run them: they only anchor the planner's estimates
against published deployments. Dims are from their public config.json files.
"""

from __future__ import annotations

from deltamoe.config import ModelConfig


def _all_mla(**dims: object) -> ModelConfig:
    layers = int(dims["num_hidden_layers"])  # type: ignore[arg-type]
    base = dict(
        model_type="kimi_linear", layer_types=("mla",) * layers, mla_use_nope=False, mla_output_gate=False,
        latent_moe_size=None, latent_moe_norm=False, attn_res_block_size=None, hidden_act="silu",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_shared_experts=1,
        max_position_embeddings=163840, vision=None,
    )
    base.update(dims)
    return ModelConfig(**base)  # type: ignore[arg-type]


def deepseek_v3() -> ModelConfig:
    """deepseek-ai/DeepSeek-V3: 671 B total, 37 B active; 3 dense layers, 256 experts top-8 in
    8 groups with top-4 groups (a token reaches at most 4 nodes)."""
    return _all_mla(vocab_size=129280, num_hidden_layers=61, num_attention_heads=128, first_k_dense_replace=3,
                    num_experts=256, num_experts_per_token=8, num_expert_group=8, topk_group=4,
                    routed_scaling_factor=2.5, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
                    pad_token_id=None)


def kimi_k2() -> ModelConfig:
    """moonshotai/Kimi-K2-Instruct: 1.04 T total, 32.9 B active; 64 heads, 384 experts top-8."""
    return _all_mla(vocab_size=163840, num_hidden_layers=61, num_attention_heads=64, first_k_dense_replace=1,
                    num_experts=384, num_experts_per_token=8, num_expert_group=1, topk_group=1,
                    routed_scaling_factor=2.827, max_position_embeddings=131072)


REFERENCE_MODELS = {"deepseek-v3": deepseek_v3, "kimi-k2": kimi_k2}
