"""Decode side: the prefill side's completion notices, watched on one thread.

A packed hand-off ends with the transfer engine's notice (`MooncakeTransport.write_as_ready`): the
decode server's engine queues it once every byte of the hand-off is in the decode server's
memory. The decode side learns of it here, not from the prefill server's HTTP answer, which
takes two more thread hand-overs (the prefill server's event loop, then this server's HTTP
client) and an HTTP response on the way: the answer stays the control path (errors, timings).

A completion marker (`markers.py`: 8 bytes the prefill side writes into this side's memory once the
hand-off's writes completed) is reported by the same poll, as a notice line of its own; the
connector's poll returns both.

The engine offers no blocking wait for notices, only `get_notifies`, so this thread polls it, and
only while some hand-off awaits its notice (also while its prompt is still being computed: the
decode side cannot tell when the prefill ends); each poll is one short C++ call, and between polls
the thread sleeps without the GIL. The poll period trades the notice's delay (half of it on
average) against the CPU the polls take beside the engine thread (a few percent of a core at the
default). A notice is lines "<key> <detail>", one per hand-off that its write completed: the key
names one hand-off (`expect`), and its callback runs on this thread with the detail. Whoever claims
a hand-off first handles it: this thread when its notice arrives, or the hand-off's own thread when
the HTTP answer comes first (`claim`: the notice was queued but not yet polled, or the hand-off
failed); a notice nobody expects any more is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

POLL_S = 100e-6  # sleep between polls while a notice is awaited (the kernel adds its timer slack)


class NoticeWatcher:
    def __init__(self, poll: Callable[[], list[str]], poll_s: float = POLL_S):
        self._poll, self._poll_s = poll, poll_s
        self._expected: dict[str, Callable[[str], None]] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="handoff-notices", daemon=True)
        self._thread.start()

    def expect(self, key: str, on_notice: Callable[[str], None]) -> None:
        """Run `on_notice(detail)` (on this watcher's thread) when the notice `key` arrives, unless claimed first."""
        with self._changed:
            self._expected[key] = on_notice
            self._changed.notify()

    def claim(self, key: str) -> bool:
        """Stop waiting for `key`; True when its notice had not been handled (the caller handles the
        hand-off), False when its callback already ran or runs now."""
        with self._changed:
            return self._expected.pop(key, None) is not None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._expected and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            for line in (line for notice in self._poll() for line in notice.split("\n")):
                key, _, detail = line.partition(" ")
                with self._changed:
                    on_notice = self._expected.pop(key, None)
                if on_notice is not None:
                    on_notice(detail)
            time.sleep(self._poll_s)
