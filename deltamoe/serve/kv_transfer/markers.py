"""Completion markers: a hand-off's end told by one 8-byte write into the decode side's memory.

The transfer engine's own notice (`MooncakeTransport.notices`) is not sent on the data connections:
the engine opens a connection of its own to the peer's handshake port for each one (connect, a JSON
message, the peer's reply, close), so telling the receiver cost more than the bytes at small sizes
(docs/serving-disagg.md: a 0.24 MiB raw write took ~0.1 ms back to back, the same write with its notice
~0.9 ms until the receiver had it). A marker instead rides on the connection lanes the data took:
once the hand-off's write completed (the engine acknowledges a write only once its bytes are in the
receiver's memory), the prefill side writes the marker's word into a registered board on the decode
side, which the decode side's watcher polls in its own memory (`notices.py`, beside the notices).
The marker is written after the data, never in the same batch: a batch's segments travel on several
lanes at once and complete in any order.

Decode side: `MarkerBoard.arm` gives a hand-off a word of the board and a value no other hand-off of
this board uses (the word is zeroed first); the prefill side writes value (+1 when packed) there;
`arrived` reports each armed word holding its value, or its value + 1, as a notice line "<key>
<packed|unpacked>" and frees the word. A word whose hand-off ended another way (the prefill server's
answer came first, or it failed) is freed by `disarm`; a late marker landing in it later cannot match
the next hand-off's value.

Prefill side: `MarkerSources` lends registered words holding the values to write (the transfer
engine writes only from registered memory), for as long as the write that reads them runs.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

from deltamoe.serve.kv_transfer.pools import Segment

MARKER_BYTES = 8  # one int64 word
BOARD_WORDS = 4096  # decode side: hand-offs awaiting their marker at once (more wait for the answer instead)
SOURCE_WORDS = 4096  # prefill side: markers being written at once (more are refused: the notice goes instead)


def _words(count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.int64)


class MarkerBoard:
    """Decode side: the registered words prefill sides set when a hand-off's bytes are all in."""

    def __init__(self, words: int = BOARD_WORDS):
        self.buffer = _words(words)
        self._free = list(range(words - 1, -1, -1))
        self._armed: dict[int, tuple[str, int]] = {}  # word -> (notice key, expected value)
        self._values = itertools.count(2, 2)  # even: +1 marks a packed hand-off
        self._lock = threading.Lock()
        self.seen = 0  # markers that arrived while armed

    def arm(self, key: str) -> tuple[int, int] | None:
        """A word for the hand-off `key`: (its address, the value to write there), or None when every
        word is armed (that hand-off then lands on the notice or the answer)."""
        with self._lock:
            if not self._free:
                return None
            word, value = self._free.pop(), next(self._values)
            self.buffer[word] = 0
            self._armed[word] = (key, value)
        return self.buffer.data_ptr() + word * MARKER_BYTES, value

    def disarm(self, address: int) -> None:
        """Free the word at `address` (its hand-off ended without its marker being seen); no-op if freed."""
        word = (address - self.buffer.data_ptr()) // MARKER_BYTES
        with self._lock:
            if self._armed.pop(word, None) is not None:
                self._free.append(word)

    def arrived(self) -> list[str]:
        """Notice lines ("<key> packed|unpacked") of the armed words whose marker is in; frees them."""
        lines = []
        with self._lock:
            if not self._armed:
                return lines
            words = list(self._armed)
            seen = self.buffer[words].tolist()  # one read of the board: markers land from other threads
            for word, value in zip(words, seen):
                key, expected = self._armed[word]
                if value in (expected, expected + 1):
                    del self._armed[word]
                    self._free.append(word)
                    self.seen += 1
                    lines.append(f"{key} {'packed' if value == expected + 1 else 'unpacked'}")
        return lines


class MarkerSources:
    """Prefill side: registered words holding the marker values being written."""

    def __init__(self, words: int = SOURCE_WORDS):
        self.buffer = _words(words)
        self._free = list(range(words - 1, -1, -1))
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def segments(self, markers: list[tuple[int, int]], packed: bool) -> Iterator[list[Segment] | None]:
        """For (decode-side address, value) pairs: a segment writing each value (+1 when `packed`) to its
        address, valid inside the block; None when too few words are free (send the notice instead)."""
        with self._lock:
            if len(markers) > len(self._free):
                words = None
            else:
                words = [self._free.pop() for _ in markers]
                for word, (_, value) in zip(words, markers):
                    self.buffer[word] = value + int(packed)
        if words is None:
            yield None
            return
        try:
            base = self.buffer.data_ptr()
            yield [Segment(base + w * MARKER_BYTES, address, MARKER_BYTES) for w, (address, _) in zip(words, markers)]
        finally:
            with self._lock:
                self._free.extend(words)
