"""Progress as plain lines where the output is not a terminal (a log file, a pipe, CI).

rich's live bar draws nothing on such a console until it stops, so a long run redirected to a file
looked stuck. The bars of `train` and `generate` fall back to this: one line when something changes,
at most every `interval` seconds, and always the last one.
"""

from __future__ import annotations

import time

from rich.console import Console


class PlainProgress:
    def __init__(self, label: str, total: int, console: Console, interval: float = 10.0):
        self.label, self.total, self.console, self.interval = label, total, console, interval
        self._last = time.monotonic()  # the first line comes after `interval`, or at the end
        self._pending: str | None = None

    def update(self, completed: int, status: str = "") -> None:
        self._pending = f"{self.label} {completed}/{self.total} {status}".rstrip()
        if completed >= self.total or time.monotonic() - self._last >= self.interval:
            self._print()

    def close(self) -> None:
        if self._pending is not None:
            self._print()

    def _print(self) -> None:
        self.console.print(self._pending, markup=False, highlight=False)
        self._pending, self._last = None, time.monotonic()
