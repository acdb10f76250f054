"""Small configs of every family member, sized to run in milliseconds."""

import pytest

from deltamoe.config import load_preset


def k31_config(**overrides):
    """K3.1-architecture toy: KDA + DSA (small top-k so T > top-k is cheap) + latent MoE + SiTU + AttnRes + MTP."""
    base = dict(vocab_size=97, hidden_size=48, num_hidden_layers=6,
                layer_types=("kda", "kda", "dsa", "kda", "dsa", "dsa"),
                kda_num_heads=3, kda_head_dim=8, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=12,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_num_heads=2, index_head_dim=8,
                index_topk=5, intermediate_size=64, num_experts=7, num_experts_per_token=3,
                moe_intermediate_size=16, latent_moe_size=20, attn_res_block_size=2, num_nextn_predict_layers=1,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    return load_preset("tiny").replace(**base)


def k3_config(**overrides):
    return k31_config(layer_types=("kda", "kda", "mla", "kda", "mla", "mla"), **overrides)


def kimi_linear_config(**overrides):
    base = dict(model_type="kimi_linear", layer_types=("kda", "kda", "mla", "kda"), num_hidden_layers=4,
                kda_gate="softplus", kda_output_gate="low_rank", mla_output_gate=False, hidden_act="silu",
                latent_moe_size=None, latent_moe_norm=False, attn_res_block_size=None, q_lora_rank=None,
                num_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0)
    base.update(overrides)
    return k31_config(**base)


def rope_mla_config(**overrides):
    """The RoPE variant of MLA (DeepSeek-style), with grouped routing, on the Kimi Linear layout."""
    return kimi_linear_config(mla_use_nope=False, rope_theta=500.0, num_experts=8, num_expert_group=2, topk_group=1,
                              num_experts_per_token=2, q_lora_rank=16, **overrides)


MEMBERS = {"k3.1": k31_config, "k3": k3_config, "kimi_linear": kimi_linear_config, "rope_mla": rope_mla_config}


@pytest.fixture(params=sorted(MEMBERS))
def member_config(request):
    return MEMBERS[request.param]()


@pytest.fixture
def configs():
    """The member builders by name, for tests that want overrides."""
    return MEMBERS
