"""Paged-block bookkeeping: ref-counted blocks with a chained hash per full block (prefix caching).

No tensors here: a block id indexes the page tensors that `HybridCache` owns. A full block gets
the hash of (previous block's hash, its tokens); a freed block keeps its hash and stays findable
until it is handed out again, least recently freed first. Sharing a prefix is then just taking
a reference on blocks whose hash matches (nano-vllm's design).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Sequence


def chain_hash(prev: int | None, tokens: Sequence[int]) -> int:
    """Stable across processes (not Python's salted hash), so a hash can travel with a hand-off."""
    h = hashlib.blake2b(digest_size=8)
    h.update((prev if prev is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int], None] = lambda h: None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._on_evict = on_evict  # told when a cached hash disappears (its KDA snapshot is useless now)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, including cached-but-unreferenced ones)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A fresh block (ref 1), the least recently freed; its old hash, if any, is forgotten."""
        if not self._free:
            raise RuntimeError("no free block (the scheduler checks num_free first)")
        block, _ = self._free.popitem(last=False)
        old = self.hashes[block]
        if old is not None:
            self.hashes[block] = self.tokens[block] = None
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
                self._on_evict(old)
        self.ref_counts[block] = 1
        return block

    def free_order(self) -> list[int]:
        """The free blocks in the order `allocate` hands them out."""
        return list(self._free)

    def restore_free_order(self, order: list[int]) -> None:
        """Hand free blocks out in `order` again (a `free_order` taken while the same blocks were free)."""
        if sorted(order) != sorted(self._free):
            raise RuntimeError("restore_free_order: the free blocks differ from the ones in the saved order")
        self._free = OrderedDict((block, None) for block in order)

    def forget_hashes(self) -> None:
        """No block is findable any more (their contents are stale, e.g. after new weights); every
        forgotten hash is reported to `on_evict`. Reference counts and the free order stay."""
        for block, old in enumerate(self.hashes):
            if old is not None:
                self.hashes[block] = self.tokens[block] = None
                if self.hash_to_block.get(old) == block:
                    del self.hash_to_block[old]
                    self._on_evict(old)
        self.hash_to_block.clear()

    def ref(self, block: int) -> None:
        """Take one more reference (a prefix hit); a cached free block comes back into use."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None  # most recently freed last: evicted last

    def lookup(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """The cached block with this hash and exactly these tokens (a hash collision is not a hit)."""
        block = self.hash_to_block.get(block_hash)
        if block is None or self.tokens[block] != tuple(tokens):
            return None
        return block

    def register(self, block: int, block_hash: int, tokens: Sequence[int]) -> None:
        """Mark a full, computed block as reusable under its chained hash (first writer wins)."""
        if self.hashes[block] is not None:
            return
        self.hashes[block] = block_hash
        self.tokens[block] = tuple(tokens)
        self.hash_to_block.setdefault(block_hash, block)
