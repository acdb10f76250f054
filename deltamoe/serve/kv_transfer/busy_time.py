"""Seconds during which at least one hand-off was on its way: the denominator of sustained throughput.

One hand-off at a time, its bytes over its own time (the prefill's finish -> its cache in the
decode side's pools) is its throughput. With several in flight their times overlap, and the sum
of their times counts the shared seconds once per hand-off: bytes over the union of their
intervals is what the link carried while busy. `BusyTime.add` merges each landed hand-off's
interval into that union; intervals end when they are added (a hand-off lands now), so only
intervals that a late one can still overlap are kept: those ending within `horizon_s` (a
hand-off's timeout) of the newest end; older ones are folded into the total.
"""

from __future__ import annotations

import threading


class BusyTime:
    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self._settled = 0.0  # seconds of intervals no later hand-off can overlap any more
        self._open: list[tuple[float, float]] = []  # merged, disjoint, by start
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        """One hand-off's interval (time.monotonic() seconds, start <= end)."""
        if end < start:
            raise ValueError(f"an interval from {start} to {end}")
        with self._lock:
            kept: list[tuple[float, float]] = []
            for s, e in self._open:
                if e < start or s > end:  # disjoint: keep as is
                    kept.append((s, e))
                else:  # overlapping: grow the new interval over it
                    start, end = min(start, s), max(end, e)
            kept.append((start, end))
            kept.sort()
            newest = max(e for _, e in kept)
            self._settled += sum(e - s for s, e in kept if e < newest - self.horizon_s)
            self._open = [(s, e) for s, e in kept if e >= newest - self.horizon_s]

    def seconds(self) -> float:
        with self._lock:
            return self._settled + sum(e - s for s, e in self._open)
