"""Storage formats and the weight schemes the CLI offers (--weights, --kv-cache).

A format is bytes per parameter including its block scales (spec §3.4, §6). A scheme says
which format the routed experts and the rest of the model use, and at which precision their
matmuls run, because a 4-bit weight does not imply a 4-bit matmul: Hopper runs MXFP4 experts
as W4A16 (BF16 tensor cores), Blackwell and Ascend 950 have native FP4, W4A8 multiplies in
FP8 or INT8.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamoe.errors import ConfigError


@dataclass(frozen=True)
class Format:
    name: str
    bytes_per_param: float
    note: str


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("bf16", 2.0, "16-bit"),
    Format("fp8", 1.0 + 4 / (128 * 128), "FP8 E4M3, fp32 scale per 128x128 block"),
    Format("mxfp4", 0.5 + 1 / 32, "OCP MXFP4: E2M1 + E8M0 scale per 32"),
    Format("int4", 0.5 + 2 / 128, "INT4, bf16 scale per 128 (W4A8/W4A16 checkpoints)"),
    Format("4bit", 0.5, "bare 4 bits, no scales (lower bound)"),
)}

# Matmul precisions in order of preference per scheme; the first one the chip has is used.
COMPUTE_PATHS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16",),
    "fp8": ("fp8", "int8", "bf16"),
    "fp4": ("fp4", "bf16"),  # W4A16 (Marlin) where there are no FP4 tensor cores
    "a8": ("fp8", "int8", "bf16"),
}


@dataclass(frozen=True)
class WeightScheme:
    name: str
    routed: Format  # routed experts
    dense: Format  # attention, dense MLP, shared experts, latent projections
    embedding: Format  # embedding, lm_head, router, norms, vision
    routed_compute: str  # key of COMPUTE_PATHS
    dense_compute: str
    description: str


WEIGHT_SCHEMES: dict[str, WeightScheme] = {s.name: s for s in (
    WeightScheme("bf16", FORMATS["bf16"], FORMATS["bf16"], FORMATS["bf16"], "bf16", "bf16",
                 "everything BF16"),
    WeightScheme("fp8", FORMATS["fp8"], FORMATS["fp8"], FORMATS["bf16"], "fp8", "fp8",
                 "FP8 block-128 for every linear layer; embedding, lm_head, router, norms and vision in BF16 "
                 "(DeepSeek-V3 style)"),
    WeightScheme("mxfp4", FORMATS["mxfp4"], FORMATS["bf16"], FORMATS["bf16"], "fp4", "bf16",
                 "MXFP4 routed experts, BF16 rest (the native K3 checkpoint)"),
    WeightScheme("w4a8", FORMATS["int4"], FORMATS["bf16"], FORMATS["bf16"], "a8", "bf16",
                 "INT4-g128 routed experts with 8-bit activations, BF16 rest"),
    WeightScheme("all-4bit", FORMATS["4bit"], FORMATS["4bit"], FORMATS["4bit"], "fp4", "fp4",
                 "every parameter at 4 bits, no scales (a lower bound, not a checkpoint)"),
)}

CLI_WEIGHTS = ("bf16", "fp8", "mxfp4", "w4a8")


@dataclass(frozen=True)
class CacheFormat:
    """How the attention caches are stored (--kv-cache)."""

    name: str
    mla_bytes: float  # per latent element
    indexer_key_bytes_per_dim: float  # DSA indexer key, per dim, scales included below
    indexer_scale_bytes: int  # per 128-dim block


KV_FORMATS: dict[str, CacheFormat] = {
    "bf16": CacheFormat("bf16", 2.0, 2.0, 0),
    # FP8 indexer keys with one fp32 scale per 128 dims: 132 B per token per layer (spec §3.2).
    "fp8": CacheFormat("fp8", 1.0, 1.0, 4),
}


def weight_scheme(name: str) -> WeightScheme:
    if name not in WEIGHT_SCHEMES:
        raise ConfigError(f"unknown weight scheme {name!r}; known: {', '.join(WEIGHT_SCHEMES)}", field="weights")
    return WEIGHT_SCHEMES[name]


def kv_format(name: str) -> CacheFormat:
    if name not in KV_FORMATS:
        raise ConfigError(f"unknown kv-cache format {name!r}; known: {', '.join(KV_FORMATS)}", field="kv-cache")
    return KV_FORMATS[name]
