"""What the hybrid cache holds per token and per sequence, and how a byte budget becomes blocks and slots.

Per token of context (paged, `block_size` tokens per block): the MLA latent (kv_lora + rope
dims) of every MLA/DSA layer and the indexer key of every DSA layer. Per sequence (fixed, one
state slot): the KDA recurrent state [H, K, V] fp32 and the short-conv state [W-1, 3P] of every
KDA layer (channels last: see `conv_shape`). Computed from the config alone, so the byte counts
need no allocation. Under tensor parallelism (`tp_size`) a rank holds the state of its
kda_num_heads / tp_size heads only; latents and indexer keys are per token, shared by all heads,
so every rank keeps them whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError


@dataclass(frozen=True)
class CacheLayout:
    block_size: int
    kda_layers: tuple[int, ...]
    latent_layers: tuple[int, ...]  # MLA and DSA layers: latent KV per token
    index_layers: tuple[int, ...]  # DSA layers: indexer key per token
    latent_dim: int
    index_dim: int
    recurrent_shape: tuple[int, int, int]  # [H, K, V], always fp32
    # [W-1, 3P], in the cache dtype: channels last, the transpose of the [B, 3P, W-1] state the conv op
    # takes and returns (the cache views swap the two axes). A compiled decode step writes a row of
    # 3P channels per tap as whole vectors; stored [3P, W-1] its loops ran along the 3 taps, one
    # masked vector each (bench/offline_step_split.py).
    conv_shape: tuple[int, int]
    dtype: torch.dtype
    kv_fp8: bool = False  # latent / index pages in e4m3 with one fp32 scale per `fp8_tile` values

    @classmethod
    def from_config(cls, config: ModelConfig, block_size: int = 16, dtype: torch.dtype = torch.float32,
                    tp_size: int = 1, kv_fp8: bool = False, mtp_layers: int = 0) -> "CacheLayout":
        """`mtp_layers`: also page the latents of that many MTP layers (indices L, L+1, ...): their
        attention runs over the context when they draft tokens (serve/spec_decode/)."""
        types = config.layer_types
        heads = config.kda_num_heads // tp_size
        return cls(
            block_size=block_size,
            kda_layers=tuple(i for i, t in enumerate(types) if t == "kda"),
            latent_layers=tuple(i for i, t in enumerate(types) if t in ("mla", "dsa"))
            + tuple(range(len(types), len(types) + mtp_layers)),
            index_layers=tuple(i for i, t in enumerate(types) if t == "dsa"),
            latent_dim=config.latent_cache_dim,
            index_dim=config.index_head_dim,
            recurrent_shape=(heads, config.kda_head_dim, config.kda_head_dim),
            conv_shape=(config.kda_conv_size - 1, 3 * heads * config.kda_head_dim),
            dtype=dtype,
            kv_fp8=kv_fp8,
        )

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        if self.kv_fp8:  # one byte a value plus an fp32 scale per tile
            return sum(n * (dim + dim // fp8_tile(dim) * 4) for n, dim in
                       ((len(self.latent_layers), self.latent_dim), (len(self.index_layers), self.index_dim)))
        values = len(self.latent_layers) * self.latent_dim + len(self.index_layers) * self.index_dim
        return values * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def bytes_per_state_slot(self) -> int:
        h, k, v = self.recurrent_shape
        w, c = self.conv_shape
        return len(self.kda_layers) * (h * k * v * 4 + c * w * self.element_bytes)


def fp8_tile(dim: int) -> int:
    """Values per fp8 scale in a cached row: the largest power of two <= 128 dividing `dim`
    (128 for the indexer keys; 64 for K3's 576-wide latent [512 | 64])."""
    tile = 128
    while dim % tile:
        tile //= 2
    return tile


@dataclass(frozen=True)
class CacheCapacity:
    num_blocks: int
    num_state_slots: int


def plan_capacity(layout: CacheLayout, budget: int, wanted_slots: int, max_state_fraction: float,
                  max_blocks: int) -> CacheCapacity:
    """Split `budget` bytes: up to `wanted_slots` state slots within `max_state_fraction`, blocks with the rest.

    A model without latent layers still gets block ids (zero bytes each, `max_blocks` of them) so
    the block tables and prefix hashes work the same for every family member.
    """
    slot_bytes = layout.bytes_per_state_slot
    slots = wanted_slots if slot_bytes == 0 else min(wanted_slots, int(budget * max_state_fraction) // slot_bytes)
    slots = max(slots, 1 if layout.kda_layers else wanted_slots)
    rest = budget - slots * slot_bytes
    blocks = max_blocks if layout.bytes_per_block == 0 else min(max_blocks, rest // layout.bytes_per_block)
    if blocks < 1 or rest < 0:
        need = slot_bytes + layout.bytes_per_block
        raise ConfigError(f"{budget} bytes cannot hold one state slot ({slot_bytes} B) and one block "
                          f"({layout.bytes_per_block} B)", field="cache_memory", hint=f"give at least {need} bytes")
    return CacheCapacity(num_blocks=blocks, num_state_slots=slots)
