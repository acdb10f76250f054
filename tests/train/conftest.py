"""A model small enough that a training step takes a few milliseconds on two cores, with every
feature the loop touches: KDA + DSA, latent MoE (router biases), AttnRes, one MTP layer."""

from __future__ import annotations

import pytest

from deltamoe.train.config import TrainConfig

MICRO_MODEL = dict(hidden_size=32, num_hidden_layers=2, layer_types=["kda", "dsa"], kda_num_heads=2,
                   kda_head_dim=16, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, index_num_heads=1, index_head_dim=8, index_topk=16,
                   intermediate_size=64, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
                   latent_moe_size=16, attn_res_block_size=1, num_nextn_predict_layers=1)


def micro_config(out, **sections) -> TrainConfig:
    """A TrainConfig on the micro model; `sections` are {"optim.lr": 1e-3}-style overrides."""
    cfg = TrainConfig.from_dict({"model": {"preset": "tiny", "overrides": dict(MICRO_MODEL)},
                                 "data": {"task": "recall", "num_pairs": 4, "num_queries": 1, "seq_len": 32, "batch_size": 8,
                                          "eval_rows": 16},
                                 "optim": {"warmup_steps": 2},
                                 "run": {"out": str(out), "steps": 4, "eval_every": 0, "progress": False}})
    cfg.update(sections)
    return cfg.validate()


@pytest.fixture
def micro(tmp_path):
    return lambda **kw: micro_config(tmp_path / "run", **kw)


@pytest.fixture(scope="session")
def micro_model_config():
    """The micro model as a ModelConfig (tests that build models directly, e.g. RL)."""
    from deltamoe.config import load_preset

    return load_preset("tiny").replace(**MICRO_MODEL)
