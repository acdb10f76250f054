"""KDA state-slot bookkeeping: one slot per running sequence, plus prefix snapshots under a cap.

Snapshots are the KDA state at a block boundary, keyed by that block's chained hash. They live
in otherwise idle slots, at most `max_snapshots` of them, least recently used evicted first; a
running sequence that needs a slot always wins over a snapshot.
"""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int, max_snapshots: int):
        self.num_slots = num_slots
        self.max_snapshots = max_snapshots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.num_running = 0
        self.snapshots_evicted = 0

    @property
    def num_available(self) -> int:
        """Slots a running sequence could get now (free ones plus evictable snapshots)."""
        return len(self._free) + len(self.snapshots)

    def allocate(self) -> int | None:
        if not self._free and self.snapshots:
            self._evict_lru()
        if not self._free:
            return None
        self.num_running += 1
        return self._free.pop()

    def free(self, slot: int) -> None:
        self.num_running -= 1
        self._free.append(slot)

    def free_order(self) -> list[int]:
        """The free slots, the next one `allocate` hands out last."""
        return list(self._free)

    def restore_free_order(self, order: list[int]) -> None:
        """Hand free slots out in `order` again (a `free_order` taken while the same slots were free)."""
        if sorted(order) != sorted(self._free):
            raise RuntimeError("restore_free_order: the free slots differ from the ones in the saved order")
        self._free = list(order)

    def lookup(self, block_hash: int) -> int | None:
        slot = self.snapshots.get(block_hash)
        if slot is not None:
            self.snapshots.move_to_end(block_hash)
        return slot

    def slot_for_snapshot(self, block_hash: int) -> int | None:
        """A slot to write a new snapshot into, or None (already held, cap 0, or no idle slot)."""
        if block_hash in self.snapshots or self.max_snapshots == 0:
            return None
        if len(self.snapshots) >= self.max_snapshots:
            self._evict_lru()
        if not self._free:
            return None
        slot = self._free.pop()
        self.snapshots[block_hash] = slot
        return slot

    def drop(self, block_hash: int) -> None:
        """Forget a snapshot whose block left the prefix cache."""
        slot = self.snapshots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def _evict_lru(self) -> None:
        _, slot = self.snapshots.popitem(last=False)
        self._free.append(slot)
        self.snapshots_evicted += 1
