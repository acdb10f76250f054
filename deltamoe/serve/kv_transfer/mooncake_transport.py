"""The Mooncake transfer engine as this package uses it: one engine per server, pools registered once.

`TransferEngine.initialize(host, "P2PHANDSHAKE", "tcp", "")` needs no metadata server: peers
exchange segment descriptors on first contact, and each engine picks a free RPC port of its
own (two servers on one host never collide). Memory is registered on both sides (the TCP
transport requires it), once, at start-up: the whole cache pools, never per request.

Writes go through the engine's synchronous calls (`transfer_sync_write`, or
`batch_transfer_sync_write` for several segments), which wait in C++ with the GIL released:
a Python loop polling `transfer_check_status` needs the GIL between polls, and next to an
engine thread running Python it made a 1 MiB write 7-20x slower than the engine itself. A
write that overlaps with producing its bytes (`write_as_ready`) submits chunks asynchronously
(`batch_transfer_async_write`) and waits for them in `get_batch_transfer_status`, which also
waits in C++ with the GIL released (handing the chunks to Python writer threads instead cost a
thread wake-up per chunk, many milliseconds each on the loaded two-core VM). It waits for each
chunk on its own: given several, that call returns at the first failed one while its siblings
are still being written, and the caller would then lend the memory they land in to another
hand-off. The engine bounds each call (`MC_TRANSFER_TIMEOUT` seconds, 5 at least, plus one
second per GiB) and answers an error for an unreachable peer; a write that returns after the
caller's deadline counts as failed too.

One waiter at a time: every call that waits in C++ (the synchronous writes, the wait for a batch)
spins on the batch's status without sleeping, a whole core per waiting thread, and with several
hand-offs in flight the spinners starve the transfer engine's own threads that move the bytes (see
docs/serving-disagg.md for the measurement). So a waiter first takes the transport's waiter lock, asleep while another
holds it; the batches it waits for travel meanwhile. It takes the lock for at most
`WAITER_PATIENCE_S`, then waits anyway: a write to a peer that stalls (the engine's timeout is
seconds) delays the others' waits by that much, not by the timeout.

Completion notices: a hand-off's last write may carry a notice (the engine's notify: a short
message that the engine sends the peer once every segment of that write completed, read there
with `get_notifies`): a synchronous batch of all the hand-off's segments carries it itself
(`write`); after asynchronous chunks, a write issued once they all completed carries it
(`finish`). The engine's TCP framing
acknowledges a write only once its bytes are in the receiver's memory (Mooncake's acknowledged
"v2" framing, unless MC_TCP_PROTO=1 forces the legacy one), so a receiver that sees the notice
has every byte of the hand-off. The engine keeps a batch's notice until the thread waiting for
that batch sees it complete, and that thread sends it then, on a connection of its own to the
peer's handshake port (not on the data connections), before it returns: a synchronous write with
a notice (`write`, `write_unless_busy`) sends it from C++ with no Python between the last byte
and the notice; after asynchronous chunks, the notice waits for a Python thread to return from
its wait and issue the notice's write. A marker written in the same batch instead would not do:
the segments of one batch travel on several connections at once (lanes, below) and complete in
any order.

Connections: by default the engine's TCP transport opens a new connection for every segment of
every write, resolving and connecting synchronously in the submitting thread (the engine thread for
a hand-off it starts itself), and each connection starts cold (TCP slow start, an accept on the
peer's one I/O thread): a hand-off pays that once per segment and once more for its notice's write.
The engine's connection lanes (`MC_TCP_ENABLE_CONNECTION_POOL`) keep a few connections per peer
open, connect them asynchronously and queue each write on one; the transport turns them on unless
the variable is set (0 turns them off; docs/serving-disagg.md has the measurement). The raw writes that
`bench/bench_serve_disagg.py` compares against go through this class too, so both sides of that
ratio use the same connections. A lane whose peer died fails its write and is dropped; a restarted
peer listens on a new port, hence is a new peer name.

The engine logs through its bundled glog, which does not read GLOG_minloglevel from the
environment: at INFO it writes a line for every handshake and every asynchronous batch.
`quiet_engine_logs` sets glog's exported threshold itself: GLOG_minloglevel when set, else ERROR.
Its P2PHANDSHAKE start logs one ERROR line that is none ("Local segment descriptor not found": it
looks its own segment up before publishing it; hand-offs then work): `engine_start_log_filtered`
holds the process's stderr in a file while the engine starts and writes every other line back.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deltamoe.errors import ConfigError
from deltamoe.serve.kv_transfer.pools import Segment

MIN_ENGINE_TIMEOUT_S = 5  # the engine's floor for MC_TRANSFER_TIMEOUT
GLOG_MIN_LEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's `FLAGS_minloglevel` (C++ name, exported)
GLOG_ERROR = 2
NOTICE_NAME = "deltamoe-hand-off"  # the notify name of hand-off completion notices
NOTICE_BYTES = 64  # what a notice's own write sends again after a chunked write
CONNECTION_LANES = "MC_TCP_ENABLE_CONNECTION_POOL"  # read by the engine's constructor
WAITER_PATIENCE_S = 0.05  # longest wait for the waiter lock before waiting without it
# What the engine writes at every start that is no error (with glog's note on its first line).
HARMLESS_START_LINES = ("Local segment descriptor not found", "Logging before InitGoogleLogging()")


def quiet_engine_logs() -> None:
    """Make the loaded Mooncake engine's glog drop lines below GLOG_minloglevel (default: ERROR), as
    glog itself would with that variable. A wheel whose glog is not a separate loaded library keeps
    logging at INFO: only the log's volume differs."""
    level = engine_log_level()
    if level is not None:
        level.value = int(os.environ.get("GLOG_minloglevel", GLOG_ERROR))


_START_LOG_LOCK = threading.Lock()  # fd 2 is the process's: one filtered start at a time


@contextlib.contextmanager
def engine_start_log_filtered() -> Iterator[None]:
    """Inside, file descriptor 2 is a pipe whose lines a thread passes on to the real stderr as they
    come, less `HARMLESS_START_LINES` (a real error the engine writes while starting still shows,
    even if the process dies right after). Nothing is filtered where fd 2 is closed."""
    with _START_LOG_LOCK:
        try:
            saved = os.dup(2)
        except OSError:  # started with stderr closed (2>&-): nothing to filter
            yield
            return
        read_end, write_end = os.pipe()

        def forward() -> None:
            with os.fdopen(read_end, "rb") as lines:
                for line in lines:
                    if not any(harmless.encode() in line for harmless in HARMLESS_START_LINES):
                        os.write(saved, line)

        with contextlib.suppress(Exception):  # Python's own buffered stderr first, in order
            sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        forwarder = threading.Thread(target=forward, name="mooncake-start-log", daemon=True)
        forwarder.start()
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)  # the pipe's last writer closed: the thread reads to its end
            forwarder.join(5)
            os.close(saved)


def engine_log_level() -> ctypes.c_int32 | None:
    """The loaded Mooncake engine's glog threshold (0 INFO .. 3 FATAL), or None where its wheel has no
    separate glog library (the engine must be imported already)."""
    import mooncake

    for lib in Path(mooncake.__file__).resolve().parent.parent.glob("mooncake_transfer_engine*.libs/libglog*.so*"):
        try:
            return ctypes.c_int32.in_dll(ctypes.CDLL(str(lib), mode=os.RTLD_NOLOAD), GLOG_MIN_LEVEL)
        except (OSError, ValueError):  # that wheel's glog is not the one loaded, or has no such flag
            continue
    return None


class TransferFailed(RuntimeError):
    """A hand-off write that failed or ran past its deadline."""


@dataclass
class ChunkedWrite:
    """A write whose chunks are on their way (`MooncakeTransport.start_chunks`); `finish` ends it."""

    peer: str
    src: int
    dst: int
    nbytes: int
    started: float  # time.monotonic() when its first chunk could go out
    batches: list[int] = field(default_factory=list)  # the engine's ids of the chunks in flight
    sent: int = 0  # leading bytes that the chunks carry
    submitted: float = 0.0  # time.monotonic() once its last chunk was submitted
    completed: float = 0.0  # ... once `finish` saw every chunk end (its notice's write follows)


class MooncakeTransport:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", timeout_s: float = 30.0):
        # Read by the engine's constructor: how long one synchronous write may wait.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(MIN_ENGINE_TIMEOUT_S, math.ceil(timeout_s))))
        os.environ.setdefault(CONNECTION_LANES, "1")  # persistent connections per peer (module docstring)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # also a missing libibverbs.so.1 (apt-get install libibverbs1)
            raise ConfigError(f"the Mooncake transfer engine cannot be loaded ({e})", field="kv_transfer",
                              hint="pip install mooncake-transfer-engine-non-cuda; apt-get install -y libibverbs1")
        quiet_engine_logs()
        self._engine = TransferEngine()
        with engine_start_log_filtered():
            started = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if started != 0:
            raise ConfigError(f"the Mooncake transfer engine cannot start on {host!r} over {protocol}",
                              field="kv_transfer_host")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        # Whether a submission only queues its segments on open connections (else it connects once per
        # segment in the submitting thread).
        self.lanes = os.environ[CONNECTION_LANES].strip().lower() not in ("0", "false", "no")
        self._registered: list[int] = []
        self._waiter = threading.Lock()  # see "One waiter at a time" above
        try:
            self._engine_timeout_s = max(MIN_ENGINE_TIMEOUT_S, int(os.environ["MC_TRANSFER_TIMEOUT"]))
        except ValueError:
            raise ConfigError(f"expected whole seconds, got {os.environ['MC_TRANSFER_TIMEOUT']!r}",
                              field="MC_TRANSFER_TIMEOUT") from None

    def write_bound_s(self, nbytes: int) -> float:
        """How long the engine lets one write of `nbytes` run before giving up on it (its own rule)."""
        return self._engine_timeout_s + nbytes / (1 << 30)

    def register(self, address: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        if self._engine.register_memory(address, nbytes) != 0:
            raise ConfigError(f"cannot register {nbytes} bytes with the Mooncake transfer engine", field="kv_transfer")
        self._registered.append(address)

    def write(self, peer: str, segments: list[Segment], timeout_s: float, notice: str | None = None,
              markers: list[Segment] | None = None) -> None:
        """Copy every segment into `peer`'s registered memory (with `notice` when given; `markers`, the
        completion markers of `markers.py`, once every segment completed); raises TransferFailed (an
        engine error, or the write ended after `timeout_s`)."""
        if timeout_s <= 0:
            raise TransferFailed(f"no time left for the hand-off to {peer}")
        start = time.monotonic()
        with self._one_waiter():
            status = self._write_sync(peer, segments, notice, markers)
        self._check_write(peer, status, start, timeout_s)

    def write_unless_busy(self, peer: str, segments: list[Segment], timeout_s: float, notice: str | None = None,
                          markers: list[Segment] | None = None) -> bool:
        """`write`, unless another thread waits on the engine now: then False at once, nothing written
        (never waits for the waiter lock: for a thread that must not stall, the prefill engine's)."""
        if timeout_s <= 0:
            raise TransferFailed(f"no time left for the hand-off to {peer}")
        if not self._waiter.acquire(blocking=False):
            return False
        start = time.monotonic()
        try:
            status = self._write_sync(peer, segments, notice, markers)
        finally:
            self._waiter.release()
        self._check_write(peer, status, start, timeout_s)
        return True

    def _write_sync(self, peer: str, segments: list[Segment], notice: str | None,
                    markers: list[Segment] | None = None) -> int:
        """One synchronous call of the engine (its status): submission, the wait and `notice` all in C++
        with the GIL released, so no Python thread stands between the batch's end and the notice; with
        `markers`, a second one writes them once the first completed (the GIL is taken only in between)."""
        status = self._write_batch(peer, segments, notice)
        if status == 0 and markers:
            status = self._write_batch(peer, markers, None)
        return status

    def _write_batch(self, peer: str, segments: list[Segment], notice: str | None) -> int:
        srcs, dsts, lengths = [s.src for s in segments], [s.dst for s in segments], [s.nbytes for s in segments]
        if notice is not None:  # the engine sends it once the whole batch completed
            from mooncake.engine import TransferNotify, TransferOpcode

            return self._engine.batch_transfer_sync(peer, srcs, dsts, lengths, TransferOpcode.Write,
                                                    TransferNotify(NOTICE_NAME, notice))
        if len(segments) == 1:
            return self._engine.transfer_sync_write(peer, srcs[0], dsts[0], lengths[0])
        return self._engine.batch_transfer_sync_write(peer, srcs, dsts, lengths)

    @staticmethod
    def _check_write(peer: str, status: int, start: float, timeout_s: float) -> None:
        if status != 0:
            raise TransferFailed(f"the hand-off write to {peer} failed (status {status}: peer unreachable, or the "
                                 "engine's own timeout)")
        if time.monotonic() - start > timeout_s:
            raise TransferFailed(f"the hand-off to {peer} took longer than {timeout_s:.1f} s")

    def write_as_ready(self, peer: str, src: int, dst: int, nbytes: int, ready: Iterable[int], min_chunk: int,
                       timeout_s: float, notice: str | None = None) -> int:
        """Copy `nbytes` from `src` to `peer`'s `dst` while the sender is still producing them
        (`start_chunks`, then `finish`). Returns the number of writes; raises TransferFailed as
        `write` does. Whatever happens, returns only once no write is in flight (the caller then
        reuses the memory, and the peer lends its range to another hand-off)."""
        if timeout_s <= 0:
            raise TransferFailed(f"no time left for the hand-off to {peer}")
        return self.finish(self.start_chunks(peer, src, dst, nbytes, ready, min_chunk), timeout_s, notice)

    def start_chunks(self, peer: str, src: int, dst: int, nbytes: int, ready: Iterable[int], min_chunk: int,
                     all_async: bool = False) -> ChunkedWrite:
        """Put a write on its way while its bytes are produced: `ready` yields how many leading bytes
        are final (non-decreasing, ending at `nbytes`), and every `min_chunk` new bytes go out as one
        asynchronous write, so the transfer engine's threads send a chunk while this thread produces
        the next; the rest goes out the same way once produced, unless no chunk went out and not
        `all_async` (then `finish` writes it all at once). Raises (the producer's error, or
        TransferFailed) only once no chunk is in flight."""
        write = ChunkedWrite(peer, src, dst, nbytes, time.monotonic())
        end = 0
        try:
            for end in ready:
                if end - write.sent >= min_chunk and end < nbytes:
                    write.batches.append(self._submit(peer, [src + write.sent], [dst + write.sent],
                                                      [end - write.sent]))
                    write.sent = end
            if end != nbytes:
                raise ValueError(f"the producer stopped at {end} of {nbytes} bytes")
            if write.batches or all_async:
                write.batches.append(self._submit(peer, [src + write.sent], [dst + write.sent],
                                                  [nbytes - write.sent]))
                write.sent = nbytes
        except BaseException:
            self._wait_each(write.batches)
            raise
        return write

    def finish(self, write: ChunkedWrite, timeout_s: float, notice: str | None = None,
               markers: list[Segment] | None = None) -> int:
        """Wait for every chunk of `write`, each until it completed or failed; then write what no
        chunk carried (synchronously), and `notice` for the peer when given: it rides on that
        write, or on a write of the last `NOTICE_BYTES` again (a notice needs a write, and a chunk
        written after the others completed, rather than beside them, costs more than a short
        write); `markers` instead of a notice: written once all of that completed. Returns the
        number of writes; raises TransferFailed as `write` does, only once no chunk is in flight."""
        failed = [status for status in self._wait_each(write.batches) if status != 0]
        write.completed = time.monotonic()
        writes = len(write.batches)
        if not failed and ((notice is not None and not markers) or write.sent < write.nbytes):
            first = write.sent if write.sent < write.nbytes else max(0, write.nbytes - NOTICE_BYTES)
            status = self._write_one(write.peer, write.src + first, write.dst + first, write.nbytes - first,
                                     None if markers else notice)
            failed, writes = [status] if status != 0 else [], writes + 1
        if not failed and markers:
            with self._one_waiter():
                status = self._write_batch(write.peer, markers, None)
            failed, writes = [status] if status != 0 else [], writes + 1
        if failed:
            raise TransferFailed(f"the hand-off write to {write.peer} failed (status {min(failed)}: peer "
                                 "unreachable, or the engine's own timeout)")
        if time.monotonic() - write.started > timeout_s:
            raise TransferFailed(f"the hand-off to {write.peer} took longer than {timeout_s:.1f} s")
        return writes

    def start_segments(self, peer: str, segments: list[Segment]) -> ChunkedWrite:
        """Put every segment on its way as one asynchronous batch and return at once (the caller never
        waits on the wire); `finish` waits for the batch and sends the notice (on a write of the last
        segment's last `NOTICE_BYTES` again). Raises TransferFailed when the batch cannot be submitted."""
        last = segments[-1]
        write = ChunkedWrite(peer, last.src, last.dst, last.nbytes, time.monotonic())
        write.batches.append(self._submit(peer, [s.src for s in segments], [s.dst for s in segments],
                                          [s.nbytes for s in segments]))
        write.sent = last.nbytes
        write.submitted = time.monotonic()
        return write

    def notices(self) -> list[str]:
        """The completion notices that arrived since the last call (their messages)."""
        return [n.msg for n in self._engine.get_notifies() if n.name == NOTICE_NAME]

    def _write_one(self, peer: str, src: int, dst: int, nbytes: int, notice: str | None) -> int:
        from mooncake.engine import TransferNotify, TransferOpcode

        with self._one_waiter():
            if notice is None:
                return self._engine.transfer_sync_write(peer, src, dst, nbytes)
            return self._engine.transfer_sync(peer, src, dst, nbytes, TransferOpcode.Write,
                                              TransferNotify(NOTICE_NAME, notice))

    def _wait_each(self, batches: list[int]) -> list[int]:
        """Each batch's status (0 = complete), once it completed or failed (a call per batch, see the
        module's docstring)."""
        statuses = []
        for batch in batches:
            with self._one_waiter():
                statuses.append(self._engine.get_batch_transfer_status([batch]))
        return statuses

    @contextlib.contextmanager
    def _one_waiter(self) -> Iterator[None]:
        """Wait in C++ as the only waiting thread, or after `WAITER_PATIENCE_S` anyway (module docstring)."""
        held = self._waiter.acquire(timeout=WAITER_PATIENCE_S)
        try:
            yield
        finally:
            if held:
                self._waiter.release()

    def _submit(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        batch = self._engine.batch_transfer_async_write(peer, srcs, dsts, lengths)
        if batch <= 0:  # the engine's "not submitted" (0: no batch id; an unreachable peer answers 0 too)
            raise TransferFailed(f"the hand-off write to {peer} could not be submitted (peer unreachable?)")
        return batch

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
