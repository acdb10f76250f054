"""HF `config.json` <-> ModelConfig for `kimi_linear`, `kimi_k3` (nested text_config) and K3.1 (`dsa_config`),
and `load_config`: a ModelConfig from any source (a preset name, either JSON form, a checkpoint folder).

Layer lists in HF files are 1-based (`linear_attn_config.full_attn_layers`, `kda_layers`).
Kimi Linear files may instead carry `layer_types` with `full_attention` / `linear_attention`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltamoe.config import MODEL_TYPES, ModelConfig, VisionConfig, list_presets, load_preset
from deltamoe.errors import ConfigError

# K3.1 `dsa_config` key names are unconfirmed publicly (spec §2.3); accept the plausible spellings.
_DSA_HEADS = ("index_n_heads", "index_num_heads", "head_count", "num_heads")
_DSA_DIM = ("index_head_dim", "key_length", "head_dim")
_DSA_TOPK = ("index_topk", "top_k", "topk")
_DSA_LAYERS = ("dsa_layers", "layers", "full_attn_layers")

# transformers' KimiLinearConfig.attribute_map aliases (old name -> canonical name).
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "model_max_length": "max_position_embeddings",
}


def load_config(source: str | Path) -> ModelConfig:
    """A preset name, a `config.json` (HF or deltamoe form), or a checkpoint folder holding one."""
    if not str(source).strip():  # Path("") is ".", which would read the working folder
        raise ConfigError(f"expected a preset name or a checkpoint folder, got {str(source)!r}", field="model",
                          hint=f"presets: {', '.join(list_presets())}")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json in {source}", field="model", hint=_model_folder_hint(path.parent))
    if path.suffix == ".json" and path.exists():
        data = read_json_object(path, field="config")
        _check_layer_count(data)
        # Every field is type-checked where it is used; what slips through (a list where a number
        # belongs, deep inside) still ends as one ConfigError naming the file, never a traceback.
        try:
            if "model_type" in data and ("architectures" in data or "text_config" in data
                                         or "linear_attn_config" in data):
                return config_from_hf(data)
            return ModelConfig.from_dict(data)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
            raise ConfigError(f"{path} has a malformed field ({type(e).__name__}: {_short(e)})",
                              field="config") from None
    if str(source) in list_presets():
        return load_preset(str(source))
    raise ConfigError(f"{source!r} is neither a preset nor a config file/folder; presets: {', '.join(list_presets())}",
                      field="model")


def read_json_object(path: Path, field: str) -> dict[str, Any]:
    """The JSON object in file `path`; ConfigError (naming `field`) for an unreadable file, bad
    UTF-8, bad JSON or a top-level value that is not an object."""
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"cannot read {path}: {e.strerror or e}", field=field) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{path} is not valid JSON ({_short(e)})", field=field) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}", field=field)
    return data


MAX_LAYERS = 4096  # far above any real model (K3: 93); per-layer lists are built from this number


def _check_layer_count(data: dict[str, Any]) -> None:
    """Refuse an absurd layer count before anything builds a list that long."""
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    for n in (data.get("num_hidden_layers"), text.get("num_hidden_layers")):
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_LAYERS:
            raise ConfigError(f"expected at most {MAX_LAYERS} layers, got {n}", field="num_hidden_layers")


def _short(e: Exception, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _table(d: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object (`text_config`, `linear_attn_config`, ...): {} when absent or null."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"expected an object, got {type(value).__name__}", field=key)
    return value


def _first(d: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _layer_types(text: dict[str, Any], n: int) -> list[str]:
    lac = _table(text, "linear_attn_config")
    if "full_attn_layers" in lac:
        full = set(lac["full_attn_layers"])
        bad = [x for x in full if not 1 <= x <= n]
        if bad:
            raise ConfigError(f"1-based layer indices must be in 1..{n}, got {bad}",
                              field="linear_attn_config.full_attn_layers")
        kda = set(lac.get("kda_layers") or (set(range(1, n + 1)) - full))
        if full & kda or len(full | kda) != n:
            raise ConfigError(f"full_attn_layers and kda_layers must partition 1..{n}",
                              field="linear_attn_config.kda_layers")
        types = ["mla" if i + 1 in full else "kda" for i in range(n)]
    elif text.get("layer_types"):
        mapping = {"full_attention": "mla", "linear_attention": "kda", "mla": "mla", "kda": "kda", "dsa": "dsa"}
        try:
            types = [mapping[t] for t in text["layer_types"]]
        except KeyError as e:
            raise ConfigError(f"unknown layer type {e.args[0]!r}; expected full_attention or linear_attention",
                              field="layer_types") from e
    else:  # transformers' KimiLinear default when nothing is given
        types = ["mla" if i and i % 4 == 0 else "kda" for i in range(n)]
    dsa = _table(text, "dsa_config")
    if dsa:
        layers = _first(dsa, _DSA_LAYERS)
        full_1b = sorted(i + 1 for i, t in enumerate(types) if t == "mla")
        if layers is not None and sorted(layers) != full_1b:
            raise ConfigError(f"dsa layers {sorted(layers)} must equal the full-attention layers {full_1b}",
                              field="dsa_config.layers")
        types = ["dsa" if t == "mla" else t for t in types]
    return types


def config_from_hf(data: dict[str, Any]) -> ModelConfig:
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unknown model_type {model_type!r}; expected one of {MODEL_TYPES}", field="model_type")
    top = data
    text = dict(_table(data, "text_config")) if model_type == "kimi_k3" else dict(data)
    if model_type == "kimi_k3" and not text:
        raise ConfigError("kimi_k3 config needs a text_config object", field="text_config")
    for old, new in _ALIASES.items():
        if old in text and new not in text:
            text[new] = text[old]
    # Values go to ModelConfig as written (no bool() or float() here): its checks name a field of the
    # wrong type, where a conversion read "false" as true or failed without naming it.
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"expected a positive integer, got {n!r}", field="num_hidden_layers")
    lac = _table(text, "linear_attn_config")
    lower = lac.get("gate_lower_bound")
    dsa = _table(text, "dsa_config")
    kw: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=text.get("vocab_size", 163840),
        hidden_size=text.get("hidden_size"),
        num_hidden_layers=n,
        layer_types=tuple(_layer_types(text, n)),
        rms_norm_eps=text.get("rms_norm_eps", 1e-5),
        max_position_embeddings=text.get("max_position_embeddings", 1048576),
        tie_word_embeddings=top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        bos_token_id=top.get("bos_token_id", text.get("bos_token_id")),
        eos_token_id=_scalar(top.get("eos_token_id", text.get("eos_token_id"))),
        pad_token_id=top.get("pad_token_id", text.get("pad_token_id")),
        kda_num_heads=lac.get("num_heads", text.get("linear_num_heads", 32)),
        kda_head_dim=lac.get("head_dim", text.get("linear_head_dim", 128)),
        kda_conv_size=lac.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
        kda_gate="lower_bound" if lower is not None else "softplus",
        kda_gate_lower_bound=lower if lower is not None else -5.0,
        kda_output_gate="full_rank" if lac.get("use_full_rank_gate") else "low_rank",
        num_attention_heads=text.get("num_attention_heads"),
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=text.get("kv_lora_rank", 512),
        qk_nope_head_dim=text.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=text.get("qk_rope_head_dim", 64),
        v_head_dim=text.get("v_head_dim", 128),
        mla_use_nope=text.get("mla_use_nope", True),
        rope_theta=text.get("rope_theta", 10000.0),
        mla_output_gate=text.get("mla_use_output_gate", False),
        index_num_heads=_first(dsa, _DSA_HEADS, 32),
        index_head_dim=_first(dsa, _DSA_DIM, 128),
        index_topk=_first(dsa, _DSA_TOPK, 2048),
        intermediate_size=text.get("intermediate_size", 0),
        first_k_dense_replace=text.get("first_k_dense_replace", _dense_from_mlp_types(text)),
        moe_layer_freq=text.get("moe_layer_freq", 1),
        num_experts=text.get("num_experts", 0),
        num_experts_per_token=text.get("num_experts_per_token", 1),
        moe_intermediate_size=text.get("moe_intermediate_size", 0),
        num_shared_experts=text.get("num_shared_experts", 0),
        latent_moe_size=text.get("routed_expert_hidden_size"),
        latent_moe_norm=text.get("latent_moe_use_norm", False),
        moe_router_activation=text.get("moe_router_activation_func", "sigmoid"),
        moe_renormalize=text.get("moe_renormalize", True),
        routed_scaling_factor=text.get("routed_scaling_factor", 1.0),
        num_expert_group=text.get("num_expert_group", 1),
        topk_group=text.get("topk_group", 1),
        hidden_act=text.get("hidden_act", "silu"),
        situ_beta=text.get("activation_situ_beta", 4.0),
        situ_linear_beta=text.get("activation_situ_linear_beta", 25.0),
        attn_res_block_size=text.get("attn_res_block_size"),
        num_nextn_predict_layers=text.get("num_nextn_predict_layers", 0),
        media_placeholder_token_id=top.get("media_placeholder_token_id"),
    )
    vc = _table(top, "vision_config") if model_type == "kimi_k3" else None
    if vc:
        kw["vision"] = VisionConfig(
            patch_size=vc.get("patch_size", 14),
            hidden_size=vc.get("hidden_size", 1024),
            num_hidden_layers=vc.get("num_hidden_layers", 27),
            num_attention_heads=vc.get("num_attention_heads", 12),
            head_dim=vc.get("head_dim", 128),
            intermediate_size=vc.get("intermediate_size", 4096),
            pos_emb_height=vc.get("pos_emb_height", 64),
            pos_emb_width=vc.get("pos_emb_width", 64),
            merge_kernel_size=tuple(vc.get("merge_kernel_size", (2, 2))),
            pos_emb_interpolation=vc.get("pos_emb_interpolation", "bilinear"),
        )
    for name in ("hidden_size", "num_attention_heads"):
        if not isinstance(kw[name], int):
            raise ConfigError(f"expected an integer, got {kw[name]!r}", field=name)
    return ModelConfig(**kw)


def _scalar(x: Any) -> Any:
    return x[0] if isinstance(x, list) and x else x


def _dense_from_mlp_types(text: dict[str, Any]) -> int:
    types = text.get("mlp_layer_types")
    if not types:
        return 1
    return next((i for i, t in enumerate(types) if t != "dense"), len(types))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    full = [i + 1 for i, t in enumerate(cfg.layer_types) if t in ("mla", "dsa")]
    kda = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"]
    lac: dict[str, Any] = {
        "head_dim": cfg.kda_head_dim,
        "num_heads": cfg.kda_num_heads,
        "short_conv_kernel_size": cfg.kda_conv_size,
        "full_attn_layers": full,
        "kda_layers": kda,
    }
    if cfg.kda_gate == "lower_bound":
        lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
    if cfg.kda_output_gate == "full_rank":
        lac["use_full_rank_gate"] = True
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "intermediate_size": cfg.intermediate_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_router_activation_func": cfg.moe_router_activation,
        "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "use_grouped_topk": True,
        "topk_method": "noaux_tc",
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": cfg.mla_use_nope,
        "mla_use_output_gate": cfg.mla_output_gate,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "linear_attn_config": lac,
    }
    if not cfg.mla_use_nope:
        text["rope_theta"] = cfg.rope_theta
    if cfg.hidden_act == "situ":
        text["activation_situ_beta"] = cfg.situ_beta
        text["activation_situ_linear_beta"] = cfg.situ_linear_beta
    if cfg.latent_moe_size is not None:
        text["routed_expert_hidden_size"] = cfg.latent_moe_size
        text["latent_moe_use_norm"] = cfg.latent_moe_norm
    if cfg.attn_res_block_size is not None:
        text["attn_res_block_size"] = cfg.attn_res_block_size
    if "dsa" in cfg.layer_types:
        if "mla" in cfg.layer_types:
            raise ConfigError("HF dsa_config covers every full-attention layer; mixed mla/dsa cannot be written",
                              field="layer_types")
        text["dsa_config"] = {
            "index_n_heads": cfg.index_num_heads,
            "index_head_dim": cfg.index_head_dim,
            "index_topk": cfg.index_topk,
            "dsa_layers": full,
        }
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.model_type == "kimi_linear":
        return {"architectures": ["KimiLinearForCausalLM"], **text, **ids}
    out: dict[str, Any] = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        **ids,
        "text_config": text,
    }
    if cfg.media_placeholder_token_id is not None:
        out["media_placeholder_token_id"] = cfg.media_placeholder_token_id
    if cfg.vision is not None:
        v = cfg.vision
        out["vision_config"] = {
            "patch_size": v.patch_size, "hidden_size": v.hidden_size, "num_hidden_layers": v.num_hidden_layers,
            "num_attention_heads": v.num_attention_heads, "head_dim": v.head_dim,
            "intermediate_size": v.intermediate_size, "pos_emb_height": v.pos_emb_height,
            "pos_emb_width": v.pos_emb_width, "merge_kernel_size": list(v.merge_kernel_size),
        }
        if v.pos_emb_interpolation != "bilinear":
            out["vision_config"]["pos_emb_interpolation"] = v.pos_emb_interpolation
    return out


def _model_folder_hint(folder: Path) -> str:
    """Where the model is when `folder` is a training run's (its export is `model/`) or one of its
    training checkpoints (`checkpoints/step-N`, a DCP folder, not a model)."""
    for run in (folder, folder.parent.parent if folder.parent.name == "checkpoints" else None):
        if run is not None and (run / "model" / "config.json").is_file():
            return f"a training run's folder: its exported model is {run / 'model'}"
    return "pass a preset name or a checkpoint folder"
