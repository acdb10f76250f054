"""Where a request's cache lives in memory: the byte ranges of its blocks and its state slot.

A HybridCache holds its pools as tensors allocated once: paged ones, latent pages and
indexer-key pages [layers, blocks * block_size, dim] (a block of a layer is one contiguous run
of block_size rows) and, with an fp8 KV cache, their fp32 scales [layers, blocks * block_size,
tiles]; and state ones, recurrent [layers, slots, H, K, V] and conv [layers, slots, W-1, 3P],
slot-major (`engine/state_storage.py`: a slot's recurrent state of every layer is one contiguous
run, and so is its conv state). A transport registers the tensors once and moves a
request either packed (`packing.py`) or as a list of (source address, destination address,
bytes) segments straight between the pools; the destination's base addresses travel in the
hand-off request (`PoolDescriptor`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

from deltamoe.config import ModelConfig
from deltamoe.serve.engine.cache import HybridCache

PAGED_POOLS = ("latent", "index_keys", "latent_scale", "index_key_scale")  # the scales: fp8 pages only
STATE_POOLS = ("recurrent", "conv")
POOLS = PAGED_POOLS + STATE_POOLS


@dataclass(frozen=True)
class Segment:
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class PoolDescriptor:
    """One engine's pools as a peer needs them: base addresses plus what must match to copy bytes."""

    session: str  # the transport's address of this engine ("host:port")
    addresses: dict[str, int]
    signature: str  # model config + weights + cache layout + dtype + block size; equal on both sides or no hand-off
    # Bytes from one layer of each pool to the next on this side. A paged pool is [layers, rows, dim]:
    # its layer stride grows with the rows, i.e. with this engine's block count, which its memory, its
    # state slots and its --tp split set (two sides of a pair differ); a state pool's does not.
    layer_bytes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PoolDescriptor":
        return cls(session=str(data["session"]), addresses={k: int(v) for k, v in data["addresses"].items()},
                   signature=str(data["signature"]),
                   layer_bytes={k: int(v) for k, v in data["layer_bytes"].items()})


def pool_tensors(cache: HybridCache) -> dict[str, torch.Tensor]:
    """The cache's pools that exist (no scales without fp8 pages), in `POOLS` order."""
    return {name: getattr(cache, name) for name in POOLS if getattr(cache, name) is not None}


def cache_signature(model_config: ModelConfig, cache: HybridCache, weights: str = "") -> str:
    """Everything that must agree for raw bytes to mean the same on both sides (not the pool sizes):
    the model config, the cache layout, and the weights that compute them (`model.fingerprint`)."""
    shapes = {name: [t.shape[0], *t.shape[2:]] for name, t in pool_tensors(cache).items()}
    dtypes = {name: str(t.dtype) for name, t in pool_tensors(cache).items()}
    # A state slot's layout inside its run (neither stride depends on the number of slots).
    state_strides = {name: list(pool_tensors(cache)[name].stride()) for name in STATE_POOLS}
    blob = json.dumps({"model": model_config.to_dict(), "block_size": cache.block_size, "shapes": shapes,
                       "dtypes": dtypes, "state_strides": state_strides, "weights": weights}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def describe(cache: HybridCache, session: str, model_config: ModelConfig, weights: str = "") -> PoolDescriptor:
    pools = pool_tensors(cache)
    return PoolDescriptor(session=session, addresses={n: t.data_ptr() for n, t in pools.items()},
                          signature=cache_signature(model_config, cache, weights),
                          layer_bytes={n: t.stride(0) * t.element_size() for n, t in pools.items()})


def request_segments(cache: HybridCache, remote: PoolDescriptor, src_blocks: list[int], dst_blocks: list[int],
                     num_tokens: int, first_block: int, src_slot: int, dst_slot: int) -> list[Segment]:
    """Segments that copy tokens [first_block * block_size, num_tokens) of every paged pool's
    layers (latent, indexer keys, their fp8 scales), and the whole state slot of every KDA layer, from this cache into the remote one.

    `src_blocks` / `dst_blocks`: the blocks holding those tokens, in order, on each side. The last
    block is copied only up to `num_tokens`; runs of consecutive blocks on both sides are merged
    into one segment, and so are segments that follow each other in memory on both sides (a slot's
    recurrent state of every layer: one segment, its conv state another, `engine/state_storage.py`).
    """
    bs = cache.block_size
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    rows = [min(bs, num_tokens - (first_block + i) * bs) for i in range(len(src_blocks))]
    runs = _runs(src_blocks, dst_blocks, rows, bs)
    segments: list[Segment] = []
    pools = pool_tensors(cache)
    for name in PAGED_POOLS:
        pool = pools.get(name)
        if pool is None or pool.numel() == 0:
            continue
        layer_bytes, row_bytes = pool.stride(0) * pool.element_size(), pool.stride(1) * pool.element_size()
        remote_layer_bytes = remote.layer_bytes[name]  # the other side's block count: its own stride
        for layer in range(pool.shape[0]):
            src_base = pool.data_ptr() + layer * layer_bytes
            dst_base = remote.addresses[name] + layer * remote_layer_bytes
            segments += [Segment(src_base + s * bs * row_bytes, dst_base + d * bs * row_bytes, n * row_bytes)
                         for s, d, n in runs]
    for name in STATE_POOLS:
        pool = pools[name]
        if pool.numel() == 0:
            continue
        layer_bytes, slot_bytes = pool.stride(0) * pool.element_size(), pool.stride(1) * pool.element_size()
        state_bytes = pool[0, 0].numel() * pool.element_size()
        for layer in range(pool.shape[0]):
            segments.append(Segment(pool.data_ptr() + layer * layer_bytes + src_slot * slot_bytes,
                                    remote.addresses[name] + layer * layer_bytes + dst_slot * slot_bytes,
                                    state_bytes))
    return merge_adjacent(segments)


def merge_adjacent(segments: list[Segment]) -> list[Segment]:
    """`segments` with each one that starts where the one before it ends, on both sides, joined to it."""
    merged: list[Segment] = []
    for s in segments:
        if merged and (last := merged[-1]).src + last.nbytes == s.src and last.dst + last.nbytes == s.dst:
            merged[-1] = Segment(last.src, last.dst, last.nbytes + s.nbytes)
        else:
            merged.append(s)
    return merged


def _runs(src: list[int], dst: list[int], rows: list[int], bs: int) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, rows) per run of blocks consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d, n in zip(src, dst, rows):
        if runs:
            s0, d0, n0 = runs[-1]
            if n0 % bs == 0 and s == s0 + n0 // bs and d == d0 + n0 // bs:
                runs[-1] = (s0, d0, n0 + n)
                continue
        runs.append((s, d, n))
    return runs
