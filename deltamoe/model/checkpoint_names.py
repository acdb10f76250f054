"""Published checkpoint tensor names <-> this model's parameter names (spec §5).

Our module tree already uses the published names, so most tensors map 1:1. The exceptions:
- K3 prefixes text weights with `language_model.`;
- routed experts are stored per expert (`experts.E.w1.weight`, or quantized `weight_packed` +
  `weight_scale` (+ `weight_shape` for int4)) but held here stacked as `experts.w1` [E, I, D];
- Kimi Linear stores its dense layer-0 MLP under `block_sparse_moe.` (K3 under `mlp.`);
- KDA `A_log` is [1,1,H,1] in Kimi Linear and [128] zero-padded in K3; we hold [H];
- transformers' in-memory layout (merged `conv1d`, `forget_gate.*`, `mlp.experts.gate_up_proj`)
  is accepted too, so a state dict dumped from `KimiLinearForCausalLM` loads as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltamoe.config import ModelConfig

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale|weight_shape)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # top level in K3 checkpoints, beside `language_model.`


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes."""

    param: str  # our parameter / buffer name
    expert: int | None = None  # slice of a stacked expert tensor
    part: str = "weight"  # "weight", or a quantized part: "weight_packed", "weight_scale", "weight_shape"
    kind: str = "copy"  # copy | a_log | split_conv | split_gate_up
    split_index: int = 0  # which third/half for split kinds


def text_prefix(config: ModelConfig) -> str:
    return "language_model." if config.model_type == "kimi_k3" else ""


def checkpoint_to_param(name: str, config: ModelConfig) -> TensorTarget | list[TensorTarget] | None:
    """Map one checkpoint tensor name to its target(s); None for tensors this model does not hold
    (the vision tower and projector of a checkpoint loaded with a text-only config)."""
    if name.startswith(VISION_PREFIXES):
        return TensorTarget(name) if config.vision is not None else None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    m = _EXPERT.match(name)
    if m:
        return TensorTarget(f"{m.group(1)}.{m.group(3)}", expert=int(m.group(2)), part=m.group(4))
    m = _LAYER.match(name)
    if not m:
        return TensorTarget(name)
    layer, rest = int(m.group(1)), m.group(2)
    base = f"model.layers.{layer}."
    dense = layer < config.num_hidden_layers and not config.is_moe_layer(layer)
    if dense and rest.startswith("block_sparse_moe.") and rest.count(".") == 2:
        return TensorTarget(base + "mlp." + rest[len("block_sparse_moe."):])  # Kimi Linear dense layer
    if rest in ("self_attn.A_log", "self_attn.forget_gate.A_log"):
        return TensorTarget(base + "self_attn.A_log", kind="a_log")
    if rest.startswith("self_attn.forget_gate."):
        return TensorTarget(base + "self_attn." + rest[len("self_attn.forget_gate."):])
    if rest == "self_attn.conv1d.weight":  # transformers merges q, k, v convs
        return [TensorTarget(base + f"self_attn.{c}_conv1d.weight", kind="split_conv", split_index=i)
                for i, c in enumerate("qkv")]
    if rest.startswith("mlp.") and not dense:  # transformers' in-memory MoE naming
        rest = "block_sparse_moe." + rest[len("mlp."):]
        if rest == "block_sparse_moe.experts.gate_up_proj":
            return [TensorTarget(base + f"block_sparse_moe.experts.{w}", kind="split_gate_up", split_index=i)
                    for i, w in enumerate(("w1", "w3"))]
        if rest == "block_sparse_moe.experts.down_proj":
            return TensorTarget(base + "block_sparse_moe.experts.w2")
    return TensorTarget(base + rest)


def param_to_checkpoint(param: str, config: ModelConfig) -> str | list[str]:
    """Published name(s) for one of our parameters; stacked experts expand to one name per expert."""
    if param.startswith(VISION_PREFIXES):
        return param
    prefix = text_prefix(config)
    m = re.match(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$", param)
    if m:
        return [f"{prefix}{m.group(1)}.{e}.{m.group(2)}.weight" for e in range(config.num_experts)]
    m = _LAYER.match(param)
    if m and config.model_type == "kimi_linear" and m.group(2).startswith("mlp."):
        return f"model.layers.{m.group(1)}.block_sparse_moe.{m.group(2)[len('mlp.'):]}"
    return prefix + param
