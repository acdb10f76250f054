"""Split one large Kineto JSON file into independently parseable slices of `traceEvents`.

orjson parses a whole document at several hundred MB/s, far faster than any streaming
parser (ijson with the C backend is several times slower), but a whole 1 GB trace turns
into ~10 GB of Python objects. So large files are cut at event boundaries into slices of a
few MB; each slice is `[` + events + `]`, parsed by orjson in a worker and reduced to
tables at once. Memory stays at a few slices per worker and both cores work on one file.

A cut is placed at `}` `,` `{` (any whitespace between, so pretty and compact both work).
If that sequence ever sat inside a string or a nested object, the slice before it would be
unbalanced and fail to parse, so a wrong cut is always detected, never silently wrong.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from deltamoe.errors import TraceError
from deltamoe.trace.schema import decode_events

BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_HEAD_LIMIT = 64 << 20  # metadata before traceEvents (pg_config at 10k ranks is ~60 KB)


@dataclass(frozen=True)
class Slice:
    """A piece of the events array: bytes (gz) or a byte range of a plain file."""

    path: str
    start: int = 0
    end: int = 0
    data: bytes | None = None
    at: int = 0  # for `data` (gz): its offset in the decompressed stream

    @property
    def offset(self) -> int:
        """Where the slice starts in the (decompressed) file."""
        return self.start if self.data is None else self.at

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.end - self.start)


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def uncompressed_size(path: str) -> int:
    """Size of the JSON text; for gzip the ISIZE trailer (mod 4 GiB, enough to choose a path)."""
    size = os.path.getsize(path)
    if size >= 18 and is_gzip(path):
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
        return max(isize, size)
    return size


def read_bytes(path: str) -> bytes:
    """The whole decompressed file (for files below the slicing threshold); one open."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"cannot read the file ({type(e).__name__}: {e})", field=path,
                         hint="the gzip stream is truncated or corrupt") from e


def parse_header(head: bytes, path: str) -> tuple[dict, int]:
    """Metadata before `traceEvents` and the offset of the first byte inside the array."""
    m = _KEY.search(head)
    if not m:
        raise TraceError("no traceEvents array found", field=path, hint="is this a Kineto trace?")
    text = head[:m.start()].rstrip().rstrip(b",")
    try:
        header = orjson.loads(text + b"}") if text.strip() != b"{" else {}
    except orjson.JSONDecodeError as e:
        raise TraceError(f"invalid JSON before traceEvents: {e}", field=path) from e
    return header, m.end()


_DECODER = json.JSONDecoder()
_WS = b" \t\r\n,"


def parse_tail(buf: bytes, path: str) -> tuple[int, dict]:
    """Where the events array ends in `buf`, and the metadata keys after it.

    `buf` must start at an event (or between events). The remaining events are walked with
    the C scanner of `json` until the closing `]`, so brackets inside later metadata (e.g.
    `deviceProperties` written after the events by older exports) cannot be mistaken for it.
    """
    text = buf.decode("utf-8", errors="replace")
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            raise TraceError("the file ends inside traceEvents", field=path, hint="the file is truncated")
        if text[i] == "]":
            break
        try:
            _, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise TraceError(f"invalid JSON near the end of traceEvents ({e.msg})", field=path,
                             hint="the file is truncated or corrupt") from e
    q = len(text[:i].encode("utf-8"))
    rest = buf[q + 1:].strip()
    try:
        if rest in (b"}", b""):
            return q, {}
        if rest.startswith(b","):
            return q, orjson.loads(b"{" + rest[1:])
    except orjson.JSONDecodeError:
        pass
    raise TraceError("invalid JSON after traceEvents", field=path, hint="the file is truncated or corrupt")


def _tail_start(buf: bytes) -> int:
    """An event start near the end of `buf`, so only the last events are walked in Python."""
    at = max(0, len(buf) - (256 << 10))
    m = BOUNDARY.search(buf, at)
    return m.start() + 1 if m else 0


def _find_end(buf: bytes, path: str) -> tuple[int, dict]:
    start = _tail_start(buf)
    try:
        q, meta = parse_tail(buf[start:], path)
        return start + q, meta
    except TraceError:
        if start == 0:
            raise
    q, meta = parse_tail(buf, path)  # the cut landed outside the events: walk them all
    return q, meta


def slices(path: str, slice_bytes: int) -> tuple[dict, Iterator[Slice]]:
    """Header metadata (incl. keys after the array) and an iterator of event slices."""
    if is_gzip(path):
        return _gzip_slices(path, slice_bytes)
    return _plain_slices(path, slice_bytes)


def _plain_slices(path: str, slice_bytes: int) -> tuple[dict, Iterator[Slice]]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(1 << 20)  # the metadata is usually far smaller; grow only if needed
        while not _KEY.search(head) and len(head) < _HEAD_LIMIT:
            more = f.read(len(head))
            if not more:
                break
            head += more
        header, first = parse_header(head, path)
        tail_at = max(first, size - (4 << 20))
        f.seek(tail_at)
        tail = f.read()
        if tail_at > first:  # start the walk at an event boundary inside the tail window
            m = BOUNDARY.search(tail)
            if m:
                tail_at += m.start() + 1
                tail = tail[m.start() + 1:]
        q, after = _find_end(tail, path)
        header.update(after)
        last = tail_at + q  # offset of the closing ']'
        cuts = [first]
        target = first + slice_bytes
        while target < last:
            cut = _next_boundary(f, target, last)
            if cut is None:
                break
            cuts.append(cut)
            target = cut + slice_bytes
    bounds = list(zip(cuts, cuts[1:] + [last]))

    def gen() -> Iterator[Slice]:
        for lo, hi in bounds:
            yield Slice(path, lo, hi)
    return header, gen()


def _next_boundary(f, at: int, limit: int) -> int | None:
    """Offset just after the first event-closing `}` at or after `at` and before `limit`.

    Reads a small window first (events are a few hundred bytes), growing it only for
    huge events: reading 1 MB per cut would read the whole file once more."""
    size = 64 << 10
    while True:
        f.seek(at)
        window = f.read(size)
        m = BOUNDARY.search(window)
        if m:
            return at + m.start() + 1 if at + m.start() < limit else None
        if len(window) < size or size >= 16 << 20:
            return None
        size *= 4


def _gzip_slices(path: str, slice_bytes: int) -> tuple[dict, Iterator[Slice]]:
    f = gzip.open(path, "rb")
    try:
        head = f.read(min(slice_bytes, _HEAD_LIMIT))
        while not _KEY.search(head) and len(head) < _HEAD_LIMIT:
            more = f.read(slice_bytes)
            if not more:
                break
            head += more
        header, first = parse_header(head, path)
    except (OSError, EOFError, zlib.error) as e:
        f.close()
        raise TraceError(f"cannot read the file ({type(e).__name__})", field=path,
                         hint="the gzip stream is truncated or corrupt") from e
    tail_meta: dict = {}

    def gen() -> Iterator[Slice]:
        buf, at = head[first:], first  # at: offset of buf in the decompressed stream
        try:
            while True:
                more = f.read(slice_bytes)
                if not more:
                    break
                buf += more
                if len(buf) < 2 * slice_bytes:
                    continue
                m = BOUNDARY.search(buf, slice_bytes)
                if not m:
                    continue
                yield Slice(path, data=buf[:m.start() + 1], at=at)
                rest = buf[m.start() + 1:].lstrip().lstrip(b",")
                at += len(buf) - len(rest)
                buf = rest
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"cannot read the file ({type(e).__name__})", field=path,
                             hint="the gzip stream is truncated or corrupt") from e
        finally:
            f.close()
        q, after = _find_end(buf, path)
        tail_meta.update(after)
        yield Slice(path, data=buf[:q], at=at)

    header["__tail__"] = tail_meta  # filled when the iterator is exhausted
    return header, gen()


def parse_slice(data: bytes) -> list:
    data = data.strip().lstrip(b",")
    if not data:
        return []
    return decode_events(b"[" + data + b"]")


_BYTE = re.compile(r"\(byte (\d+)\)")


def slice_error_message(sl: Slice, data: bytes, error: Exception) -> str:
    """The decoder's message for a slice that did not parse, with its "(byte N)" (counted in the
    `[` + slice + `]` that parse_slice decoded) turned into the offset in the file."""
    rest = data.lstrip()
    lead = len(data) - len(rest)
    lead += len(rest) - len(rest.lstrip(b","))
    text = str(error)

    def at(m: re.Match) -> str:
        return f"(byte {sl.offset + lead + max(0, int(m.group(1)) - 1)} of the file)"
    out, n = _BYTE.subn(at, text)
    return out if n else f"{text} (in the slice at byte {sl.offset} of the file)"
