"""ModelConfig: every knob of the Kimi Linear / K3 / K3.1 Pro family in one frozen dataclass.

The config is dims only. Presets are JSON files in `deltamoe/presets/`; `deltamoe.hf_config`
translates HF `config.json` both ways and holds `load_config`, which reads any config source.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltamoe.errors import ConfigError

LAYER_TYPES = ("kda", "mla", "dsa")
KDA_GATES = ("softplus", "lower_bound")
KDA_OUTPUT_GATES = ("low_rank", "full_rank")
ACTIVATIONS = ("silu", "situ")
MODEL_TYPES = ("kimi_linear", "kimi_k3")
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT3d vision tower + projector (K3). Dims only; see spec §2.2."""

    patch_size: int = 14
    hidden_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 12
    head_dim: int = 128
    intermediate_size: int = 4096
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel_size: tuple[int, int] = (2, 2)
    in_channels: int = 3
    projector_eps: float = 1e-5
    # How the learned position table is resized to an image's patch grid (F.interpolate mode):
    # "bilinear" per spec §2.2; MoonViT in transformers' Kimi-K2.5 port uses "bicubic".
    pos_emb_interpolation: str = "bilinear"

    @property
    def projector_in(self) -> int:
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]


# What each annotation of ModelConfig accepts: a config.json's "8" or true where a number goes
# failed later with a TypeError that named no field (or, for a boolean, was read as truthy).
_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "int | None": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "None or an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _check_field_types(config: "ModelConfig") -> None:
    for f in dataclasses.fields(config):
        check = _TYPE_CHECKS.get(str(f.type))
        if check is not None and not check[0](getattr(config, f.name)):
            raise ConfigError(f"expected {check[1]}, got {getattr(config, f.name)!r}", field=f.name)



@dataclass(frozen=True)
class ModelConfig:
    """All dimensions and switches of one family member.

    Layer i is `layer_types[i]` (kda | mla | dsa). Layer i has a dense MLP when
    i < first_k_dense_replace, else a (latent) MoE when (i % moe_layer_freq == 0).
    """

    # --- trunk
    model_type: str = "kimi_k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    # --- KDA (linear attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate: str = "lower_bound"  # "softplus" (Kimi Linear) | "lower_bound" (K3)
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: str = "full_rank"  # "low_rank" (Kimi Linear) | "full_rank" (K3)
    # --- MLA (latent attention)
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    rope_theta: float = 10000.0
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6
    # --- DSA lightning indexer (K3.1 Pro); used by layers typed "dsa"
    index_num_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # --- FFN
    intermediate_size: int = 33792  # dense MLP width (first_k_dense_replace layers)
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    num_shared_experts: int = 2  # built as ONE MLP of width num_shared_experts * moe_intermediate_size
    latent_moe_size: int | None = 3584  # routed experts work at this width (None: hidden width)
    latent_moe_norm: bool = True  # RMSNorm(latent) after the expert combine
    moe_router_activation: str = "sigmoid"
    moe_router_bias: bool = True  # e_score_correction_bias, used for selection only
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "situ"  # "silu" (SiLU-GLU) | "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # --- residual stream, MTP, vision
    attn_res_block_size: int | None = 12  # Block AttnRes; None = plain pre-norm residual
    num_nextn_predict_layers: int = 0
    # MTP depths trained per position: 1 = one per MTP layer (DeepSeek-V3); D > 1 applies the one MTP
    # layer D times, as the speculative drafter reuses it for drafts 2..D (model/mtp_chain.py).
    mtp_train_depth: int = 1
    vision: VisionConfig | None = None
    media_placeholder_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mtp_depths(self) -> int:
        """MTP losses per position in training: one per MTP layer, or `mtp_train_depth` of the one layer."""
        return self.num_nextn_predict_layers if self.mtp_train_depth == 1 else self.mtp_train_depth

    @property
    def kda_dim(self) -> int:
        """Projection width P = heads * head_dim of a KDA layer."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_expert_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write: the latent width or the hidden width."""
        return self.latent_moe_size or self.hidden_size

    @property
    def latent_cache_dim(self) -> int:
        """Values cached per token per MLA layer: compressed latent + shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def is_attention_layer(self, i: int) -> bool:
        return self.layer_types[i] in ("mla", "dsa")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(ok: bool, fieldname: str, expected: str) -> None:
            if not ok:
                got = getattr(self, fieldname, None)
                raise ConfigError(f"expected {expected}, got {got!r}", field=fieldname)

        _check_field_types(self)
        need(self.model_type in MODEL_TYPES, "model_type", f"one of {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "a positive integer")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"{self.num_hidden_layers} entries (num_hidden_layers)")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"layer {i} has unknown type {t!r}; expected one of {LAYER_TYPES}",
                                  field=f"layer_types[{i}]")
        need(self.kda_gate in KDA_GATES, "kda_gate", f"one of {KDA_GATES}")
        need(self.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "a negative number")
        need(self.kda_output_gate in KDA_OUTPUT_GATES, "kda_output_gate", f"one of {KDA_OUTPUT_GATES}")
        need(self.kda_conv_size >= 1, "kda_conv_size", ">= 1")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"one of {ACTIVATIONS}")
        need(self.moe_router_activation == "sigmoid", "moe_router_activation", "'sigmoid'")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "None or a positive integer")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", ">= 0")
        need(self.mla_use_nope or self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "an even number for RoPE")
        if self.num_experts > 0:
            need(1 <= self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"between 1 and num_experts ({self.num_experts})")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "a positive integer")
            need(self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0,
                 "num_expert_group", f"a divisor of num_experts ({self.num_experts})")
            need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"between 1 and num_expert_group ({self.num_expert_group})")
        for name in ("num_experts", "num_shared_experts", "moe_intermediate_size", "intermediate_size"):
            need(getattr(self, name) >= 0, name, ">= 0")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", ">= 1")
        need(self.first_k_dense_replace >= 0, "first_k_dense_replace", ">= 0")
        if self.first_k_dense_replace > 0 or self.num_experts == 0:
            need(self.intermediate_size > 0, "intermediate_size", "a positive integer (dense MLP width)")
        need(self.latent_moe_size is None or self.latent_moe_size > 0, "latent_moe_size", "None or a positive integer")
        need(not self.latent_moe_norm or self.latent_moe_size is not None, "latent_moe_norm",
             "False when latent_moe_size is None (the norm acts on the latent width)")
        if "dsa" in self.layer_types:
            need(self.index_num_heads > 0, "index_num_heads", "a positive integer for dsa layers")
            need(self.index_head_dim > 0, "index_head_dim", "a positive integer for dsa layers")
            need(self.index_topk > 0, "index_topk", "a positive integer for dsa layers")
            need(self.q_lora_rank is not None, "q_lora_rank",
                 "an integer: the DSA indexer reads the MLA q latent")
        need(self.attn_res_block_size is None or self.attn_res_block_size > 0, "attn_res_block_size",
             "None or a positive integer")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", ">= 0")
        need(isinstance(self.mtp_train_depth, int) and self.mtp_train_depth >= 1, "mtp_train_depth",
             "a positive integer")
        need(self.mtp_train_depth == 1 or self.num_nextn_predict_layers == 1, "mtp_train_depth",
             "1 unless the model has exactly one MTP layer (num_nextn_predict_layers = 1) to apply recursively")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "a positive number")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            need(tok is None or 0 <= tok < self.vocab_size, name, f"None or a token id below vocab_size ({self.vocab_size})")
        if self.vision is not None:
            _validate_vision(self.vision)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"_comment", "_source"})
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}", field=unknown[0],
                              hint="see deltamoe.config.ModelConfig for the valid names")
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("vision"), dict):
            v = dict(kwargs["vision"])
            if "merge_kernel_size" in v:
                v["merge_kernel_size"] = tuple(v["merge_kernel_size"])
            kwargs["vision"] = VisionConfig(**v)
        if "layer_types" in kwargs:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong types surface as TypeError from comparisons
            raise ConfigError(str(e), field="config") from e


def _validate_vision(v: VisionConfig) -> None:
    for name in ("patch_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "intermediate_size", "pos_emb_height", "pos_emb_width"):
        if not isinstance(getattr(v, name), int) or getattr(v, name) <= 0:
            raise ConfigError(f"expected a positive integer, got {getattr(v, name)!r}", field=f"vision.{name}")
    if v.head_dim % 4:
        raise ConfigError(f"expected a multiple of 4 (2-D rotary pairs per axis), got {v.head_dim}",
                          field="vision.head_dim")
    if v.pos_emb_interpolation not in ("bilinear", "bicubic"):
        raise ConfigError(f"expected 'bilinear' or 'bicubic', got {v.pos_emb_interpolation!r}",
                          field="vision.pos_emb_interpolation")


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """K3 schedule: full attention at every 4th layer (1-based) plus the last one; KDA elsewhere."""
    full = set(range(4, num_layers + 1, 4)) | {num_layers}
    return tuple("mla" if i + 1 in full else "kda" for i in range(num_layers))


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> ModelConfig:
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(list_presets())}", field="preset")
    return ModelConfig.from_dict(json.loads(path.read_text()))
