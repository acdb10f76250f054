"""ModelConfig: presets, HF config.json round trips, validation errors naming the field."""

import json

import pytest

from deltamoe.config import ModelConfig, list_presets, load_preset
from deltamoe.errors import ConfigError
from deltamoe.hf_config import config_from_hf, config_to_hf, load_config


@pytest.mark.parametrize("name", list_presets())
def test_preset_round_trips_through_hf_json(name):
    cfg = load_preset(name)
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_k3_schedule_matches_spec():
    cfg = load_preset("kimi-k3")
    full = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    assert full == list(range(3, 92, 4)) + [92]
    assert len(full) == 24 and cfg.layer_types.count("kda") == 69
    assert cfg.layer_types[0] == "kda" and not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))
    hf = config_to_hf(cfg)
    assert hf["model_type"] == "kimi_k3" and hf["text_config"]["linear_attn_config"]["full_attn_layers"][-2:] == [92, 93]


def test_k31_dsa_config_on_full_attention_layers():
    cfg = load_preset("kimi-k3.1-pro")
    hf = config_to_hf(cfg)
    dsa = hf["text_config"]["dsa_config"]
    assert dsa["dsa_layers"] == hf["text_config"]["linear_attn_config"]["full_attn_layers"]
    assert (dsa["index_n_heads"], dsa["index_head_dim"], dsa["index_topk"]) == (32, 128, 2048)
    # alternative key spellings are accepted
    hf["text_config"]["dsa_config"] = {"head_count": 32, "key_length": 128, "top_k": 2048, "layers": dsa["dsa_layers"]}
    assert config_from_hf(hf) == cfg
    hf["text_config"]["dsa_config"]["layers"] = [1, 2]
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf)
    assert e.value.field == "dsa_config.layers"


def test_transformers_kimi_linear_config_parses():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.0, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                            "full_attn_layers": [4]}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = config_from_hf(hf_cfg.to_dict())
    assert cfg.layer_types == ("kda", "kda", "kda", "mla")
    assert (cfg.kda_gate, cfg.kda_output_gate, cfg.mla_output_gate) == ("softplus", "low_rank", False)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.shared_expert_size) == (8, 2, 32)
    assert cfg.latent_moe_size is None and cfg.attn_res_block_size is None and cfg.hidden_act == "silu"
    # and back: transformers reads what we write
    back = transformers.KimiLinearConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    assert back.layer_types == hf_cfg.layer_types and back.num_local_experts == 8


@pytest.mark.parametrize("change, field", [
    ({"num_experts_per_token": 17, "num_experts": 16}, "num_experts_per_token"),
    ({"layer_types": ("kda",) * 7 + ("gqa",)}, "layer_types[7]"),
    ({"layer_types": ("kda",) * 3}, "layer_types"),
    ({"model_type": "llama"}, "model_type"),
    ({"kda_gate": "relu"}, "kda_gate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"latent_moe_size": None}, "latent_moe_norm"),
    ({"q_lora_rank": None}, "q_lora_rank"),  # DSA needs the q latent
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        load_preset("tiny").replace(**change)
    assert e.value.field == field
    assert field.split("[")[0] in e.value.one_line()


def test_unknown_model_type_and_preset():
    with pytest.raises(ConfigError) as e:
        config_from_hf({"model_type": "mixtral", "num_hidden_layers": 2})
    assert e.value.field == "model_type" and "kimi_linear" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("no-such-preset")
    assert "tiny" in str(e.value)
    for empty in ("", " "):  # Path("") is the working folder: named as empty, not "no config.json in"
        with pytest.raises(ConfigError) as e:
            load_config(empty)
        assert e.value.field == "model" and "got" in str(e.value) and "tiny" in e.value.hint
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({"hidden_sise": 3})
    assert e.value.field == "hidden_sise"


def test_config_file_and_folder(tmp_path):
    cfg = load_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    assert load_config(tmp_path) == cfg
    assert load_config(tmp_path / "config.json") == cfg
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "bad.json")


@pytest.mark.parametrize("key, value, field", [
    ("tie_word_embeddings", "false", "tie_word_embeddings"),  # was read as truthy: tied, lm_head dropped
    ("num_experts", "8", "num_experts"),
    ("rope_theta", "big", "rope_theta"),
    ("rms_norm_eps", "abc", "rms_norm_eps"),
    ("num_hidden_layers", True, "num_hidden_layers"),
    ("num_experts", -8, "num_experts"),
    ("num_shared_experts", -1, "num_shared_experts"),
    ("mla_use_nope", "yes", "mla_use_nope"),
])
def test_hf_config_values_of_the_wrong_type_name_their_field(key, value, field):
    hf = config_to_hf(load_preset("tiny"))
    text = hf["text_config"]
    (hf if key == "tie_word_embeddings" else text)[key] = value
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf)
    assert e.value.field == field


def test_a_training_run_folder_points_to_its_exported_model(tmp_path):
    """`generate RUN` or `generate RUN/checkpoints/step-N` (a DCP folder): the hint names RUN/model."""
    from deltamoe.hf_config import load_config

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    for folder in (run, run / "checkpoints" / "step-00000004"):
        with pytest.raises(ConfigError) as e:
            load_config(folder)
        assert e.value.hint == f"a training run's folder: its exported model is {run / 'model'}"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert e.value.hint == "pass a preset name or a checkpoint folder"
