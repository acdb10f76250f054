"""A request's cache as one contiguous message: what a packed hand-off writes in a single transfer.

Layout (the same on both sides, since the pools' shapes and dtypes must match): for each pool
in `pools.POOLS` order that the cache has, the request's part of every layer, each part
starting on a 64-byte boundary:
- paged pools [layers, rows, *row]: the rows of tokens [first_block * block_size, num_tokens),
  in token order, as [layers, tokens, *row];
- state pools [layers, slots, *state]: the request's slot, as [layers, *state].
The sender gathers its rows and slot into such a message (`pack`); the receiver scatters the
message into its own rows and slot (`unpack`): one gather or scatter per pool, however
scattered the blocks are.
"""

from __future__ import annotations

import math

import torch

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.kv_transfer.pools import PAGED_POOLS, pool_tensors
from deltamoe.serve.kv_transfer.staging import ALIGN


def token_rows(blocks: list[int], first_block: int, num_tokens: int, block_size: int) -> torch.Tensor:
    """Pool rows of tokens [first_block * block_size, num_tokens), held by `blocks` in order."""
    count = num_tokens - first_block * block_size
    rows = torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)
    return rows.flatten()[:count]


def message_parts(cache: HybridCache, num_rows: int) -> list[tuple[str, int, tuple[int, ...], int]]:
    """(pool, byte offset, shape, bytes) of each pool's part of a message carrying `num_rows` token rows."""
    parts, offset = [], 0
    for name, pool in pool_tensors(cache).items():
        if pool.numel() == 0:
            continue
        shape = (pool.shape[0], num_rows, *pool.shape[2:]) if name in PAGED_POOLS else (pool.shape[0], *pool.shape[2:])
        nbytes = math.prod(shape) * pool.element_size()
        parts.append((name, offset, shape, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return parts


def message_bytes(cache: HybridCache, num_rows: int) -> int:
    """The packed message's size, alignment included."""
    name, offset, shape, nbytes = message_parts(cache, num_rows)[-1]
    return -(-(offset + nbytes) // ALIGN) * ALIGN


def payload_bytes(cache: HybridCache, num_rows: int) -> int:
    """The request's own bytes in a message (no alignment): what an unpacked hand-off writes too."""
    return sum(nbytes for *_, nbytes in message_parts(cache, num_rows))


def pack(cache: HybridCache, rows: torch.Tensor, slot: int, out: torch.Tensor) -> None:
    """Gather the request's rows and state slot into `out` (uint8, at least `message_bytes` long)."""
    pools = _copyable(cache)
    for name, view in _views(cache, len(rows), out):
        pool = pools[name]
        if name in PAGED_POOLS:
            torch.index_select(pool, 1, rows, out=view)
        else:
            view.copy_(pool.select(1, slot))


def unpack(cache: HybridCache, rows: torch.Tensor, slot: int, message: torch.Tensor) -> None:
    """Scatter a packed message into this cache's `rows` and state `slot`."""
    pools = _copyable(cache)
    for name, view in _views(cache, len(rows), message):
        pool = pools[name]
        if name in PAGED_POOLS:
            pool[:, rows] = view  # index_put: ~1.5x index_copy_'s speed on CPU for rows this short
        else:
            pool.select(1, slot).copy_(view)


def _views(cache: HybridCache, num_rows: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    pools = _copyable(cache)
    return [(name, buffer[offset:offset + nbytes].view(pools[name].dtype).view(shape))
            for name, offset, shape, nbytes in message_parts(cache, num_rows)]


def _copyable(cache: HybridCache) -> dict[str, torch.Tensor]:
    """The pools, fp8 ones as their bytes (torch's CPU index_copy has no float8 kernel)."""
    return {name: pool.view(torch.uint8) if pool.element_size() == 1 else pool
            for name, pool in pool_tensors(cache).items()}
