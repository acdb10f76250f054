"""A request's cache as one contiguous message: what a packed hand-off writes (in a few large chunks).

Layout (the same on both sides, since the pools' shapes and dtypes must match): for each pool
in `pools.POOLS` order that the cache has, the request's part of every layer, each part
starting on a 64-byte boundary:
- paged pools [layers, rows, *row]: the rows of tokens [first_block * block_size, num_tokens),
  in token order, as [layers, tokens, *row];
- state pools [layers, slots, *state]: the request's slot, as [layers, *state].
The sender gathers its rows and slot into such a message (`pack`, or `pack_in_steps` a pool at
a time, so that the message's head travels while its tail is gathered); the receiver scatters the
message into its own rows and slot (`unpack`): per pool, every layer at once, one gather or
scatter of whole blocks (a block of a layer is one contiguous run of rows, so each index moves
block_size rows at once) and one copy of the last block's rows, however scattered the blocks are.
A few large copies, not one per layer: at a few hundred KiB each torch call's fixed cost, not
the bytes, decides how long a gather takes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.kv_transfer.pools import PAGED_POOLS, pool_tensors
from deltamoe.serve.kv_transfer.staging import ALIGN


@dataclass(frozen=True)
class TokenRows:
    """Pool rows of a request's tokens: whole blocks in order, then the first `count % block_size`
    rows of the last block (tokens from a block boundary: the hand-off never splits a block it
    skips)."""

    blocks: torch.Tensor  # long, the blocks holding the rows, in token order
    block_size: int
    count: int
    tail_start: int = 0  # the pool row of the partial last block's first row (0 when there is none)

    def __len__(self) -> int:
        return self.count

    @property
    def whole_blocks(self) -> int:
        return self.count // self.block_size

    def to(self, device: torch.device | str) -> "TokenRows":
        """The same rows with the block index on `device` (a pool's index must live beside it)."""
        return TokenRows(self.blocks.to(device), self.block_size, self.count, self.tail_start)

    def flat(self) -> torch.Tensor:
        """Every row id, in token order (the reference form)."""
        rows = self.blocks[:, None] * self.block_size + torch.arange(self.block_size)
        return rows.flatten()[:self.count]


def token_rows(blocks: list[int], first_block: int, num_tokens: int, block_size: int) -> TokenRows:
    """Pool rows of tokens [first_block * block_size, num_tokens), held by `blocks` in order."""
    count = num_tokens - first_block * block_size
    if not 0 < count <= len(blocks) * block_size or count <= (len(blocks) - 1) * block_size:
        raise ValueError(f"{len(blocks)} blocks of {block_size} for {count} rows")
    tail_start = blocks[count // block_size] * block_size if count % block_size else 0
    return TokenRows(torch.tensor(blocks, dtype=torch.long), block_size, count, tail_start)


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


def pack(cache: HybridCache, rows: TokenRows, slot: int, out: torch.Tensor) -> None:
    """Gather the request's rows and state slot into `out` (uint8, at least `message_bytes` long)."""
    for _ in pack_in_steps(cache, rows, slot, out):
        pass


def pack_in_steps(cache: HybridCache, rows: TokenRows, slot: int, out: torch.Tensor) -> Iterator[int]:
    """`pack`, one pool at a time (all its layers at once): after each, yields how many leading bytes
    of `out` are final, the last time `message_bytes` (its alignment included), so a sender writes
    them while it gathers the rest (`MooncakeTransport.write_as_ready`)."""
    pools = _copyable(cache)
    parts = _views(cache, len(rows), out)
    for i, (name, view, end) in enumerate(parts):
        if name in PAGED_POOLS:
            pool_blocks, message_blocks, pool_tail, message_tail = _by_block(pools[name], view, rows)
            torch.index_select(pool_blocks, 1, rows.blocks[:rows.whole_blocks], out=message_blocks)
            message_tail.copy_(pool_tail)
        else:
            view.copy_(pools[name].select(1, slot))
        yield end if i < len(parts) - 1 else -(-end // ALIGN) * ALIGN


def unpack(cache: HybridCache, rows: TokenRows, slot: int, message: torch.Tensor) -> None:
    """Scatter a packed message into this cache's `rows` and state `slot`."""
    pools = _copyable(cache)
    for name, view, _ in _views(cache, len(rows), message):
        pool = pools[name]
        if name in PAGED_POOLS:
            pool_blocks, message_blocks, pool_tail, message_tail = _by_block(pool, view, rows)
            pool_blocks.index_copy_(1, rows.blocks[:rows.whole_blocks], message_blocks)
            pool_tail.copy_(message_tail)
        else:
            pool.select(1, slot).copy_(view)


def _by_block(pool: torch.Tensor, view: torch.Tensor, rows: TokenRows) -> tuple[torch.Tensor, ...]:
    """Views of a paged pool [layers, rows, *row] and of its part of a message [layers, rows.count, *row]:
    both as [layers, blocks, a block's elements] for the whole blocks (views, never copies: `view`
    raises where a copy would be needed), and the rows of the last, partial block (empty when there
    is none)."""
    bs, whole = rows.block_size, rows.whole_blocks
    n = whole * bs
    pool_blocks = pool.view(pool.shape[0], pool.shape[1] // bs, -1)
    message_blocks = view[:, :n].view(pool.shape[0], whole, pool_blocks.shape[2])
    first = rows.tail_start
    return pool_blocks, message_blocks, pool[:, first:first + rows.count - n], view[:, n:]


def _views(cache: HybridCache, num_rows: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor, int]]:
    """(pool, its part of the message in `buffer` as a tensor, the part's end in bytes), in message order."""
    pools = _copyable(cache)
    return [(name, buffer[offset:offset + nbytes].view(pools[name].dtype).view(shape), offset + nbytes)
            for name, offset, shape, nbytes in message_parts(cache, num_rows)]


def _copyable(cache: HybridCache) -> dict[str, torch.Tensor]:
    """The pools, fp8 ones as their bytes (torch's CPU index_copy has no float8 kernel)."""
    return {name: pool.view(torch.uint8) if pool.element_size() == 1 else pool
            for name, pool in pool_tensors(cache).items()}
