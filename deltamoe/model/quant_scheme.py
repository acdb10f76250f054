"""Which weights a quantized checkpoint holds in which format, read from and written to the
`quantization_config` of config.json in the compressed-tensors form real checkpoints use.

Formats (`deltamoe quantize --format`):
- `int4`: W4A16, symmetric INT4 per group of `group_size` (default 128) along the input dim,
  compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K/8] (eight values + 8 per
  word, the first in the low bits), `weight_scale` bf16 [N, K/group], `weight_shape` int64 [2].
  Every decoder Linear and the routed experts; `ignore` keeps lm_head, the MTP heads and
  `kv_b_proj` (the absorbed MLA decode reads its matrix) in bf16.
- `w4a8`: the same weights plus dynamic per-token activations (`input_activations`): int8
  (asymmetric) or fp8 (e4m3).
- `mxfp4`: the native K3 form, routed experts only, `mxfp4-pack-quantized`: `weight_packed`
  u8 [N, K/2] E2M1 codes, `weight_scale` u8 [N, K/32] E8M0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from deltamoe.errors import CheckpointError
from deltamoe.ops.quant import (
    INT4_GROUP,
    MXFP4_GROUP,
    dequantize_int4,
    dequantize_mxfp4,
    quantize_int4,
    quantize_mxfp4,
)

FORMATS = ("int4", "w4a8", "mxfp4")
ACTIVATIONS = ("int8", "fp8")
PARTS = {"int4": ("weight_packed", "weight_scale", "weight_shape"), "mxfp4": ("weight_packed", "weight_scale")}
ROUTED_EXPERTS = r"re:.*block_sparse_moe\.experts.*"
DEFAULT_IGNORE = ("lm_head", r"re:.*\.head$", r"re:.*kv_b_proj$")
_INT4_OFFSET = 8
_PACK_FACTOR = 8  # int4 values per int32 word


@dataclass(frozen=True)
class QuantScheme:
    format: str  # int4 | w4a8 | mxfp4
    group_size: int = INT4_GROUP
    activations: str | None = None  # w4a8 only: int8 | fp8
    ignore: tuple[str, ...] = field(default=DEFAULT_IGNORE)

    @property
    def weight_format(self) -> str:
        """How the weights are stored: "int4" (int4 and w4a8) or "mxfp4"."""
        return "mxfp4" if self.format == "mxfp4" else "int4"

    @property
    def experts_only(self) -> bool:
        return self.format == "mxfp4"

    def quantizes(self, module_name: str, in_features: int) -> bool:
        """Whether the Linear (or expert projection) `module_name` is stored quantized."""
        if in_features % self.group_size != 0 or any(name_matches(p, module_name) for p in self.ignore):
            return False
        return not self.experts_only or ".experts." in module_name or module_name.endswith(".experts")


def name_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def make_scheme(fmt: str, group_size: int | None = None, activations: str | None = None) -> QuantScheme:
    """The scheme `deltamoe quantize --format fmt` writes; ValueError naming the bad field."""
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {fmt!r}")
    if fmt == "mxfp4":
        if group_size not in (None, MXFP4_GROUP):
            raise ValueError(f"group_size: MXFP4 groups are {MXFP4_GROUP}, got {group_size}")
        if activations is not None:
            raise ValueError("activations: MXFP4 experts run with full-precision activations (W4A16)")
        return QuantScheme("mxfp4", MXFP4_GROUP, None, ignore=(r"re:.*shared_experts.*",))
    group_size = INT4_GROUP if group_size is None else group_size
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"group_size: expected 32, 64, 128 or 256, got {group_size}")
    if fmt == "w4a8":
        activations = activations or "fp8"
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
    elif activations is not None:
        raise ValueError("activations: only --format w4a8 quantizes activations")
    return QuantScheme(fmt, group_size, activations)


# --------------------------------------------------------------- config.json entry


def scheme_to_config(scheme: QuantScheme) -> dict:
    """The compressed-tensors `quantization_config` entry."""
    if scheme.format == "mxfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                   "group_size": MXFP4_GROUP, "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": [ROUTED_EXPERTS], "weights": weights,
                                              "input_activations": None}},
                "ignore": list(scheme.ignore)}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": scheme.group_size, "dynamic": False}
    acts = None
    if scheme.activations == "int8":
        acts = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True}
    elif scheme.activations == "fp8":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": list(scheme.ignore)}


def scheme_from_config(qc: dict) -> QuantScheme:
    """Read a compressed-tensors `quantization_config` this code can execute; CheckpointError otherwise."""
    where = "config.json: quantization_config"
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"quant_method {qc.get('quant_method')!r} is not supported (compressed-tensors only)",
                              field=where)
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise CheckpointError(f"expected one config group, got {len(groups)}", field=where)
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    ignore = tuple(qc.get("ignore") or ())
    fmt = qc.get("format") or groups[0].get("format")  # newer compressed-tensors name it per group
    if fmt == "mxfp4-pack-quantized":
        return QuantScheme("mxfp4", MXFP4_GROUP, None, ignore=ignore)
    if fmt != "pack-quantized" or weights.get("num_bits") != 4 or weights.get("type") != "int" \
            or not weights.get("symmetric", False):
        raise CheckpointError(f"weights {weights} in format {fmt!r}: only symmetric int4 pack-quantized and "
                              f"mxfp4-pack-quantized are supported", field=where)
    if acts is None:
        return QuantScheme("int4", int(weights["group_size"]), None, ignore=ignore)
    kind = {"int": "int8", "float": "fp8"}.get(acts.get("type"))
    if acts.get("num_bits") != 8 or not acts.get("dynamic") or kind is None:
        raise CheckpointError(f"input_activations {acts}: only dynamic per-token int8 or fp8 are supported",
                              field=where)
    return QuantScheme("w4a8", int(weights["group_size"]), kind, ignore=ignore)


# --------------------------------------------------------------- tensor parts


def int4_to_int32_words(packed: torch.Tensor) -> torch.Tensor:
    """u8 [N, K/2] (signed nibbles) -> compressed-tensors int32 [N, K/8] (values + 8, first in the low bits)."""
    offset = packed ^ 0x88  # +8 mod 16 on both nibbles: two's complement -> offset binary
    return offset.contiguous().view(torch.int32)  # little-endian: byte b of a word holds values 2b, 2b+1


def int32_words_to_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `int4_to_int32_words`."""
    return words.contiguous().view(torch.uint8) ^ 0x88


def quantize_weight(scheme: QuantScheme, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """float [N, K] -> the published tensors of one quantized weight."""
    if scheme.weight_format == "mxfp4":
        packed, scale = quantize_mxfp4(w)
        return {"weight_packed": packed, "weight_scale": scale}
    packed, scale = quantize_int4(w, scheme.group_size)
    return {"weight_packed": int4_to_int32_words(packed), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def int4_parts(name: str, parts: dict[str, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (u8 [N, K/2], bf16 scale) from an int4 weight's published tensors."""
    words, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    if words.dtype != torch.int32 or words.dim() != 2:
        raise CheckpointError(f"weight_packed: expected int32 [N, K/8], got {words.dtype} {tuple(words.shape)}",
                              field=name)
    n, k = (int(v) for v in shape.tolist())
    if tuple(words.shape) != (n, k // _PACK_FACTOR) or tuple(scale.shape) != (n, k // group_size):
        raise CheckpointError(f"weight_packed {tuple(words.shape)} / weight_scale {tuple(scale.shape)} do not "
                              f"fit weight_shape {(n, k)} with group_size {group_size}", field=name)
    return int32_words_to_int4(words), scale.to(torch.bfloat16)


def dequantize_weight(scheme: QuantScheme, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The published tensors of one weight -> fp32 [N, K] (the reference every fast form matches)."""
    try:
        if scheme.weight_format == "mxfp4":
            return dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"], dtype=torch.float32)
        packed, scale = int4_parts(name, parts, scheme.group_size)
        return dequantize_int4(packed, scale, scheme.group_size, dtype=torch.float32)
    except ValueError as e:
        raise CheckpointError(f"bad {scheme.weight_format} tensor: {e}", field=name) from e
