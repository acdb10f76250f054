"""A registered byte area that hand-offs borrow ranges of: the packed form of a request's cache.

The transfer engine pays a fixed cost per write (a request over its TCP transport, tens of
microseconds), so a request whose blocks are scattered over the pools, a write per run of
blocks per layer, moves at a few percent of the wire's speed. Packed, the sender gathers the
request into a range of its own area, writes that range (in a few large chunks) into a range
of the receiver's area, and the receiver scatters it into its pools. Each area is one tensor,
registered once with the transport at start-up; a hand-off borrows a range for its duration.
"""

from __future__ import annotations

import threading
import time

import torch

ALIGN = 64  # every borrowed range starts on a cache line (and on any pool dtype's element size)


class StagingArea:
    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # pages are touched only where ranges are used
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, length), by offset
        self._changed = threading.Condition()

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    def fits(self, nbytes: int) -> bool:
        return _aligned(nbytes) <= self.nbytes

    def borrow(self, nbytes: int, deadline: float) -> int | None:
        """Offset of a free range of `nbytes` (first fit), waiting for one until `deadline`
        (time.monotonic()); None when the area is too small for it or the deadline passed."""
        size = _aligned(nbytes)
        if size > self.nbytes:
            return None
        with self._changed:
            while True:
                for i, (offset, length) in enumerate(self._free):
                    if length >= size:
                        self._free[i:i + 1] = [(offset + size, length - size)] if length > size else []
                        return offset
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def give_back(self, offset: int, nbytes: int) -> None:
        size = _aligned(nbytes)
        with self._changed:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:  # join neighbours, so large ranges come back
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged
            self._changed.notify_all()

    def free_bytes(self) -> int:
        with self._changed:
            return sum(length for _, length in self._free)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
