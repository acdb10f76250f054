"""MooncakeConnector: the prefill and decode halves of a hand-off over the Mooncake transfer engine.

The hand-off (vLLM's scheme for models with a recurrent state): the prefill server computes the
prompt's first N-1 tokens and writes their latent / indexer blocks and the KDA recurrent + conv
state after token N-1 straight into the decode server's pools; the decode server then runs the
last prompt token itself, so its first step yields the first output token from fresh logits,
with its own sampler and generator (seeded sampling continues exactly as in one engine).

Decode side (`RemotePrefill` on a sequence): at admission the scheduler reserves blocks for the
N-1 tokens and a state slot; `update_state_after_alloc` then asks the prefill server (through
`prefill_client`, an HTTP call in a server) to compute and write into exactly those blocks,
skipping the leading blocks that this engine's prefix cache already held. The request runs once
the hand-off landed (its completion notice, or that call's answer if it comes first); until then
(also when it is aborted) its blocks stay pinned.

Prefill side (`PushTo` on a sequence): when the request finishes its N-1 tokens,
`request_finished` starts the write (on the engine thread itself up to `inline_start_bytes`, and
any direct one over connection lanes, see below; the rest on a hand-off thread) and keeps the
blocks and slot pinned until the write ends. Over connection lanes, a direct hand-off of up to
`inline_write_bytes` is written whole by the engine thread, notice included, in one synchronous
call of the transfer engine (`_write_inline`), unless another thread waits on the transport then;
once the step ends (`step_ended`), with the others of that step to the same peer, one notice for all.
Prefix caching works as in any engine: cached blocks are not recomputed, and are sent like the rest
(the decode side lacks them).

The write goes straight into the decode side's pools (zero-copy: no gather, no staging, no scatter)
as one batch of segments, one per run of blocks per layer of each paged pool and two for the state
slot (recurrent, conv: each one run of every layer, `engine/state_storage.py`), when the request is
few segments for its size (`HandOffConfig.direct_max_segments`: each segment pays the transport's
fixed cost, a packed write pays a gather and a scatter). A more scattered request fitting both
servers' staging areas (`staging.py`) is packed: the decode side lends a range of its area, the
prefill side gathers the request into a range of its own, a pool at a time, and writes each
`write_chunk_bytes` of it as soon as they are gathered (the transfer engine sends a chunk while this
thread gathers the next). The engine thread submits a hand-off of up to `inline_start_bytes` itself
(a packed one when a range is free at once), and any direct one when the transport has connection
lanes (its submission then only queues the segments, whatever their size; without lanes it connects
once per segment), every byte as asynchronous writes, so that the hand-off thread, which waits for
them and sends the notice, wakes up while they travel. Either way a completion notice (`notices.py`)
follows once every write completed (a completion marker written into the decode side's memory,
`markers.py`, when the decode side armed one; else the transfer engine's notice): the decode side
scatters the message into its blocks and slot (packed) and lets the request run as soon as the
notice arrives, without waiting for the prefill call's answer, which still reports errors and timings.

A staging range is lent for as long as a write may still land in it: the prefill side answers
only once each of its writes completed or failed (`MooncakeTransport.write_as_ready`), and when
the call ends with no answer (the prefill server unreachable, or gone quiet past the timeout)
the decode side keeps the range out of use for as long as the transfer engine lets a write run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from deltamoe.config import ModelConfig
from deltamoe.errors import RequestError
from deltamoe.model.fingerprint import updated_fingerprint
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import parse_bytes
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.kv_transfer.busy_time import BusyTime
from deltamoe.serve.kv_transfer.clock import monotonic_clock_id
from deltamoe.serve.kv_transfer.connector import FinishedTransfers, KVConnector
from deltamoe.serve.kv_transfer.markers import MarkerBoard, MarkerSources
from deltamoe.serve.kv_transfer.mooncake_transport import ChunkedWrite, MooncakeTransport, TransferFailed
from deltamoe.serve.kv_transfer.notices import POLL_S, NoticeWatcher
from deltamoe.serve.kv_transfer.image_payload import images_to_json
from deltamoe.serve.kv_transfer.packing import TokenRows, message_bytes, pack_in_steps, payload_bytes, token_rows, unpack
from deltamoe.serve.kv_transfer.pools import PoolDescriptor, Segment, describe, pool_tensors, request_segments
from deltamoe.serve.kv_transfer.role_config import DIRECT_MAX_SEGMENTS, INLINE_WRITE, MARKERS
from deltamoe.serve.kv_transfer.staging import StagingArea

# Asks a prefill server (its URL) to compute a prompt and write it into this engine; returns its
# report ({"bytes", "seconds", ...}) or raises: TransferFailed for the server's own answer that the
# hand-off failed, PrefillUnanswered (or any other error) when no answer came. The third argument
# bounds the call in seconds.
PrefillClient = Callable[[str, dict, float], dict]


class PrefillUnanswered(TransferFailed):
    """The prefill call ended without the prefill server's answer: its writes may still be running."""


@dataclass
class RemotePrefill:
    """Decode side: this request's prompt is computed by the prefill server at `url`."""

    url: str
    loaded: bool = False  # set once the load was asked for: a preempted request recomputes locally


@dataclass
class PushTo:
    """Prefill side: where the request's computed cache goes when its N-1 tokens are done."""

    dest: PoolDescriptor
    first_block: int  # leading blocks the decode side already holds (not sent)
    dst_blocks: list[int]
    dst_slot: int
    timeout_s: float
    finished_at: float = 0.0  # time.monotonic() when the prefill finished (the hand-off's start)
    staging: tuple[int, int] | None = None  # (address, bytes) of the decode side's range for a packed write
    deadline: float = 0.0  # time.monotonic() by which the write ends, one way or the other
    notice: str | None = None  # the decode side's key for the completion notice
    marker: tuple[int, int] | None = None  # (address, value) of the decode side's completion marker (`markers.py`)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Landing:
    """Decode side: one hand-off on its way in, handled by whoever claims it (`notices.py`)."""

    request_id: str
    key: str  # its completion notice's key
    rows: TokenRows
    slot: int
    nbytes: int  # the request's bytes (`payload_bytes`)
    start: float  # time.monotonic() when the load was asked for
    staging: tuple[int, int] | None = None  # (offset, bytes) of the range lent to it
    marker: int | None = None  # the address of its completion marker's word (`markers.py`), if one was armed
    unpacking: float = 0.0  # time.monotonic() when its scatter started (or would have)
    cached: float = 0.0  # ... and when the cache was in the pools
    landed: threading.Event = field(default_factory=threading.Event)


@dataclass
class HandOffConfig:
    host: str = "127.0.0.1"  # the address peers reach this server's transfer engine at
    timeout_s: float = 30.0  # a whole hand-off (prefill queue + compute + write), decode side
    push_share: float = 0.8  # the prefill side finishes (or gives up) within this share of it
    min_prompt_tokens: int = 2  # decode side: shorter prompts are computed here, with no hand-off
    max_threads: int = 16  # hand-offs in flight at once (a decode side waits on HTTP in each)
    staging_bytes: int = 64 << 20  # registered area for packed hand-offs (larger requests go unpacked)
    write_chunk_bytes: int = 1 << 20  # a packed write goes out in chunks of this many bytes as they are gathered
    notice_poll_s: float = POLL_S  # decode side: sleep between polls for completion notices while one is awaited
    # Decode side: ask for a completion marker (`markers.py`) rather than the transfer engine's notice
    # (`--kv-transfer-markers`).
    markers: bool = MARKERS
    inline_start_bytes: int = 4 << 20  # prefill side: the engine thread starts hand-offs of up to this many bytes
    # Prefill side, over connection lanes: the engine thread writes a direct hand-off of up to this many bytes
    # itself, in one synchronous call that also sends its notice, when no other thread waits on the
    # transport (it holds the next step for about a raw write of these bytes; 0: never).
    inline_write_bytes: int = parse_bytes(INLINE_WRITE, "kv_transfer_inline_write")
    # Prefill side: a hand-off goes straight into the decode side's pools (no gather, no staging, no
    # scatter) when it is at most this many segments plus one per `direct_bytes_per_segment` of it (a
    # segment's fixed cost in the transfer engine against the copies a packed hand-off makes).
    direct_max_segments: int = DIRECT_MAX_SEGMENTS  # below zero: packed whenever the decode side lends a range
    direct_bytes_per_segment: int = 48 << 10
    weights: str = ""  # `model.fingerprint.weights_fingerprint` of the served weights: part of the signature


class MooncakeConnector(KVConnector):
    def __init__(self, config: HandOffConfig | None = None, prefill_client: PrefillClient | None = None):
        self.config = config or HandOffConfig()
        self.prefill_client = prefill_client
        self.transport: MooncakeTransport | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(self.config.max_threads, thread_name_prefix="handoff")
        self._lock = threading.Lock()
        self._finished = FinishedTransfers()
        self._in_flight: set[str] = set()
        self._totals = {"sent": 0, "received": 0, "failures": 0, "bytes_sent": 0, "bytes_received": 0,
                        "seconds_sent": 0.0, "seconds_received": 0.0, "unpacked": 0,
                        "seconds_packing": 0.0, "seconds_writing": 0.0, "seconds_unpacking": 0.0,
                        "writes": 0, "seconds_queued": 0.0, "landed_on_notice": 0,
                        "timed": 0, "seconds_finish_to_cache": 0.0, "seconds_notice": 0.0,
                        "seconds_submitting": 0.0, "seconds_transferring": 0.0, "seconds_notifying": 0.0,
                        "written_inline": 0, "seconds_inline": 0.0, "segments_direct": 0}
        # Completion notices' keys: this connector's own prefix (a late notice meant for an earlier
        # server on the same address never matches) and a count.
        self._notice_prefix, self._landings = secrets.token_hex(4), 0
        self._busy = BusyTime(self.config.timeout_s)  # decode side: hand-offs' timed intervals, overlaps once
        self._not_inline: set[str] = set()  # prefill side: peers a write inline failed to (see `_write_inline`)
        self._step_pushes: list[PendingPush] = []  # prefill side: inline candidates of the running step
        self.markers, self.marker_sources = MarkerBoard(), MarkerSources()  # registered by `bind`

    def bind(self, cache: HybridCache, model_config: ModelConfig) -> None:
        super().bind(cache, model_config)
        self.transport = MooncakeTransport(self.config.host, timeout_s=self.config.timeout_s)
        self.staging = StagingArea(self.config.staging_bytes)
        for tensor in [*pool_tensors(cache).values(), self.staging.buffer, self.markers.buffer,
                       self.marker_sources.buffer]:  # once: never per request
            self.transport.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        self.descriptor = describe(cache, self.transport.session, model_config, self.config.weights)
        # A hand-off's end: its completion marker in this side's memory, or the transfer engine's notice.
        self.notices = NoticeWatcher(lambda: [*self.transport.notices(), *self.markers.arrived()],
                                     self.config.notice_poll_s)

    def weights_updated(self, tensors: dict) -> None:
        """The signature a peer compares carries the weights' fingerprint: after an update it is the
        fingerprint with the update folded in (`model.fingerprint.updated_fingerprint`), so a prefill
        server and a decode server hand off again only once both took the same update."""
        self.config = dataclasses.replace(self.config, weights=updated_fingerprint(self.config.weights, tensors))
        self.descriptor = describe(self.cache, self.transport.session, self.model_config, self.config.weights)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed: int) -> int:
        hand_off = seq.kv_transfer
        # Prompt logprobs need every prompt position's hidden state, which a hand-off does not carry
        # (only the cache and the state after it): such a request's prompt is computed here.
        if (not isinstance(hand_off, RemotePrefill) or hand_off.loaded or seq.num_preemptions
                or seq.num_prompt_tokens < self.config.min_prompt_tokens or seq.params.prompt_logprobs is not None):
            return 0
        if seq.images is not None and seq.images.positions[-1] == seq.num_prompt_tokens - 1:
            return 0  # the prefill side computes prompt[:-1], which would cut the last image's placeholders

        return max(0, seq.num_prompt_tokens - 1 - num_computed)

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        hand_off: RemotePrefill = seq.kv_transfer
        hand_off.loaded = True
        bs = self.cache.block_size
        first_block = seq.num_computed // bs
        num_tokens = seq.num_computed + num_external_tokens
        last = -(-num_tokens // bs)
        rows = token_rows(seq.block_table[first_block:last], first_block, num_tokens, bs)
        payload = {"transfer_id": seq.request_id, "token_ids": seq.token_ids[:seq.num_prompt_tokens],
                   "first_block": first_block, "dst_blocks": seq.block_table[first_block:last], "dst_slot": seq.slot,
                   "dest": self.descriptor.to_json()}  # _load adds "timeout_s" and "staging"
        if seq.images is not None:  # the prefill side embeds them as this side would (image_payload.py)
            payload["images"] = images_to_json(seq.images.images)
        with self._lock:
            self._in_flight.add(seq.request_id)
        self._threads.submit(self._load, seq.request_id, hand_off.url, payload, rows, seq.slot)

    def request_finished(self, seq: Sequence, reason: str) -> bool:
        with self._lock:
            if seq.request_id in self._in_flight:
                return True  # a load or a push still writes or reads these blocks
        push = seq.kv_transfer
        if not isinstance(push, PushTo):
            return False
        if reason == "abort":
            push.done.set_exception(TransferFailed("the prefill was aborted before its hand-off"))
            return False
        push.finished_at = time.monotonic()
        with self._lock:
            self._in_flight.add(seq.request_id)
        src_blocks = seq.block_table[push.first_block:push.first_block + len(push.dst_blocks)]
        # This thread puts a hand-off on its way at once (written straight into the pools: a small one,
        # or any over connection lanes, where its submission only queues the segments; gathered and
        # written packed when small and a range of the staging area is free now): the hand-off thread
        # then starts while the bytes travel, not before. A large packed one would hold this thread
        # (the next step) for its whole gather, and the thread hand-over is a small part of its time:
        # the hand-off thread does it all.
        started, segments = None, None
        try:
            segments = request_segments(self.cache, push.dest, src_blocks, push.dst_blocks, seq.num_computed,
                                        push.first_block, seq.slot, push.dst_slot)
            if self._direct(push, segments):
                self._add("segments_direct", len(segments))
                if self._inline_candidate(push, segments):  # written or started once the step ends (`step_ended`)
                    self._step_pushes.append(PendingPush(seq.request_id, push, src_blocks, seq.num_computed, seq.slot,
                                                         segments))
                    return True
                if self.transport.lanes or sum(s.nbytes for s in segments) <= self.config.inline_start_bytes:
                    started = self._start_direct(push, segments)
            else:
                segments = None
                if push.staging[1] <= self.config.inline_start_bytes:
                    started = self._start_packed(push, src_blocks, seq.num_computed, seq.slot, wait=False)
        except Exception as e:  # fails this hand-off only, on its thread
            started = StartedPush(None, 0, 0, error=e)
        self._threads.submit(self._push, seq.request_id, push, src_blocks, seq.num_computed, seq.slot, segments,
                             started)
        return True

    def step_ended(self) -> None:
        """Write the direct hand-offs small enough to write inline that the step finished, once it knows
        them all: those to one peer together, in one synchronous call whose one notice names every one
        of them (`_write_inline`), up to `inline_write_bytes` a call; written one after the other, each
        would wait for the one before it, notice included. A group the engine thread cannot write (another
        thread waits on the transport) goes out as an asynchronous batch per hand-off, at once, and the
        hand-off threads send each notice as its batch completes."""
        pending, self._step_pushes = self._step_pushes, []
        for group in inline_groups(pending, self.config.inline_write_bytes):
            if group[0].push.dest.session not in self._not_inline and self._write_inline(group):
                continue
            for p in group:
                try:
                    started = self._start_direct(p.push, p.segments)
                except Exception as e:  # fails this hand-off only, on its thread
                    started = StartedPush(None, 0, 0, error=e)
                self._threads.submit(self._push, p.request_id, p.push, p.src_blocks, p.num_tokens, p.slot,
                                     p.segments, started)

    def _direct(self, push: PushTo, segments: list[Segment]) -> bool:
        """Write straight into the decode side's pools (else packed, through the staging areas): always
        when no range was lent or it does not fit this side's area, else when the request is few
        segments for its size (`HandOffConfig.direct_max_segments`; below zero: never)."""
        if push.staging is None or not self.staging.fits(push.staging[1]):
            return True
        if self.config.direct_max_segments < 0:
            return False
        nbytes = sum(s.nbytes for s in segments)
        return len(segments) <= self.config.direct_max_segments + nbytes // self.config.direct_bytes_per_segment

    # ------------------------------------------------------------------ worker side
    def get_finished(self) -> FinishedTransfers:
        with self._lock:
            done, self._finished = self._finished, FinishedTransfers()
        return done

    def stats(self) -> dict[str, float]:
        with self._lock:
            totals = self._totals | {"seconds_busy": self._busy.seconds(), "in_flight": len(self._in_flight),
                                     "markers_seen": self.markers.seen}
        return {f"kv_transfer_{k}": float(v) for k, v in totals.items()}

    def counter_stats(self) -> frozenset[str]:
        return frozenset(f"kv_transfer_{k}" for k in (*self._totals, "seconds_busy", "markers_seen"))

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        if hasattr(self.prefill_client, "close"):  # an HTTP client's connections
            self.prefill_client.close()
        if self.transport is not None:
            self.notices.close()
            self.transport.close()

    # ------------------------------------------------------------------ hand-off threads
    def _load(self, request_id: str, url: str, payload: dict, rows: TokenRows, slot: int) -> None:
        start = time.monotonic()
        deadline = start + self.config.timeout_s
        with self._lock:
            self._landings += 1
            key = f"{self._notice_prefix}-{self._landings}"
        landing = Landing(request_id, key, rows, slot, payload_bytes(self.cache, len(rows)), start)
        expected = False
        try:
            if self.prefill_client is None:
                raise TransferFailed("this server has no prefill client (it is not a decode server)")
            size = message_bytes(self.cache, len(rows))
            if self.staging.fits(size):  # waits while other hand-offs hold the area (bounded)
                offset = self.staging.borrow(size, deadline)
                if offset is None:
                    raise TransferFailed(f"the staging area stayed full for {self.config.timeout_s:.1f} s")
                landing.staging = (offset, size)
                payload["staging"] = [self.staging.address + offset, size]
            payload["notice"] = key
            if self.config.markers and (marker := self.markers.arm(key)) is not None:
                landing.marker = marker[0]
                payload["marker"] = list(marker)
            self.notices.expect(key, lambda detail: self._land(landing, detail == "packed", on_notice=True))
            expected = True
            left = deadline - time.monotonic()
            payload["timeout_s"] = left * self.config.push_share
            report = self.prefill_client(url, payload, left)
        except Exception as e:  # any failure fails this request only, with the reason
            if not expected or self.notices.claim(key):  # no notice came: the hand-off failed
                if landing.marker is not None:  # a late marker cannot match the word's next value
                    self.markers.disarm(landing.marker)
                self._give_back(landing, answered=isinstance(e, TransferFailed) and not isinstance(e, PrefillUnanswered))
                self._end(request_id, "received", error=f"prefill hand-off from {url} failed: {e}")
            # else the notice came first: every byte arrived, whatever the prefill server says since
            return
        if self.notices.claim(key):  # the answer came before the notice was polled
            self._land(landing, bool(report.get("packed")), on_notice=False)
        landing.landed.wait()
        if landing.marker is not None:  # freed already when its marker was seen
            self.markers.disarm(landing.marker)
        self._time_from_prefill(report, landing)

    def _land(self, landing: Landing, packed: bool, on_notice: bool) -> None:
        """The whole hand-off is in this engine's memory: scatter it (packed), free its range and let
        the request run."""
        try:
            landing.unpacking = time.monotonic()
            if packed:
                offset, size = landing.staging
                unpack(self.cache, landing.rows, landing.slot, self.staging.buffer[offset:offset + size])
            landing.cached = time.monotonic()
            self._add("seconds_unpacking", landing.cached - landing.unpacking if packed else 0.0)
            self._add("landed_on_notice", int(on_notice))
        except Exception as e:
            self._end(landing.request_id, "received", error=f"the hand-off could not be scattered: {e}")
        else:
            self._end(landing.request_id, "received", nbytes=landing.nbytes, seconds=landing.cached - landing.start)
        finally:
            self._give_back(landing, answered=True)
            landing.landed.set()

    def _give_back(self, landing: Landing, answered: bool) -> None:
        """Return the landing's staging range: now when no write can still land in it (the notice came,
        or the prefill server answered: it answers once each write ended), else once the transfer
        engine would have given up on any write still running."""
        if landing.staging is None:
            return
        offset, size = landing.staging
        if answered:
            self.staging.give_back(offset, size)
        else:
            timer = threading.Timer(self.transport.write_bound_s(size), self.staging.give_back, (offset, size))
            timer.daemon = True
            timer.start()

    def _push(self, request_id: str, push: PushTo, src_blocks: list[int], num_tokens: int, slot: int,
              segments: list[Segment] | None, started: "StartedPush | None") -> None:
        """`segments`: the request's segments when it goes straight into the decode side's pools, None
        when packed; `started`: what the engine thread already put on its way (or why it failed)."""
        start = time.monotonic()
        self._add("seconds_queued", start - push.finished_at)  # the prefill's finish -> this thread runs
        packed = segments is None
        try:
            if started is not None and started.error is not None:
                raise started.error
            if started is not None or packed:
                nbytes, writes = self._finish_started(
                    push, started or self._start_packed(push, src_blocks, num_tokens, slot, wait=True))
            else:
                writing = time.monotonic()
                with self._completion([push], packed=False) as (notice, markers):
                    self.transport.write(push.dest.session, segments, max(0.0, push.deadline - time.monotonic()),
                                         notice=notice, markers=markers)
                self._add("seconds_writing", time.monotonic() - writing)
                nbytes, writes = sum(s.nbytes for s in segments), 1 + bool(markers)
        except Exception as e:
            self._push_failed(request_id, push, e)
            return
        self._pushed(request_id, push, nbytes, writes, packed, start=push.finished_at if started is not None else start)

    def _pushed(self, request_id: str, push: PushTo, nbytes: int, writes: int, packed: bool, start: float) -> None:
        """A push's every write completed (its notice sent): count it, answer the decode side's call."""
        written = time.monotonic()
        self._add("writes", writes)
        self._end(request_id, "sent", nbytes=nbytes, seconds=written - start, unpacked=not packed)
        push.done.set_result({"bytes": nbytes, "seconds": written - start, "segments": writes, "packed": packed,
                              "clock": monotonic_clock_id(), "finished_at": push.finished_at, "written_at": written})

    def _push_failed(self, request_id: str, push: PushTo, error: Exception) -> None:
        self._end(request_id, "sent", error=str(error))
        push.done.set_exception(error if isinstance(error, TransferFailed) else TransferFailed(str(error)))

    def _inline_candidate(self, push: PushTo, segments: list[Segment]) -> bool:
        """Whether `_write_inline` may write this direct hand-off (see there)."""
        return (self.transport.lanes and sum(s.nbytes for s in segments) <= self.config.inline_write_bytes
                and push.dest.session not in self._not_inline)

    def _write_inline(self, group: list["PendingPush"]) -> bool:
        """On the engine thread as the step ends: write direct hand-offs to one peer and their notice in
        one synchronous call of the transfer engine, which waits in C++ with the GIL released and sends
        the notice as the batch completes: no thread hand-over, and no Python thread that must win the
        GIL between the bytes and the notice (a hand-off thread waited for it beside the engine thread
        and the event loop). The one notice names every hand-off of the call, one line each: the decode
        side has all their bytes once it arrives. Only over connection lanes (without them it would
        connect once per segment on this thread), up to `inline_write_bytes` a call, when no other thread
        waits on the transport (then False: the caller starts them as before), and to a peer no inline
        write failed to: a stalled peer holds this thread for the engine's bound on a write once, never
        again. True: the hand-offs ended (written, or failed)."""
        peer, writing = group[0].push.dest.session, time.monotonic()
        for p in group:
            if p.push.deadline <= writing:  # not the peer's fault: it keeps its inline writes
                self._push_failed(p.request_id, p.push, TransferFailed(f"no time left for the hand-off to {peer}"))
        group = [p for p in group if p.push.deadline > writing]
        if not group:
            return True
        segments = [s for p in group for s in p.segments]
        try:
            with self._completion([p.push for p in group], packed=False) as (notice, markers):
                if not self.transport.write_unless_busy(peer, segments, min(p.push.deadline for p in group) - writing,
                                                        notice=notice, markers=markers):
                    return False
        except Exception as e:
            self._not_inline.add(peer)
            for p in group:
                self._push_failed(p.request_id, p.push, e)
            return True
        seconds = time.monotonic() - writing
        with self._lock:  # per hand-off: the time of the call that wrote it
            self._totals["written_inline"] += len(group)
            self._totals["seconds_inline"] += seconds * len(group)
            self._totals["seconds_writing"] += seconds * len(group)
        for p in group:
            self._pushed(p.request_id, p.push, sum(s.nbytes for s in p.segments), writes=1 + bool(markers),
                         packed=False, start=p.push.finished_at)
        return True

    def _start_packed(self, push: PushTo, src_blocks: list[int], num_tokens: int, slot: int,
                      wait: bool) -> "StartedPush | None":
        """Gather the request into a range of this side's staging area, a pool at a time, sending each
        `write_chunk_bytes` into the decode side's range as soon as they are gathered. `wait`: on the
        hand-off thread, wait for a range until the deadline; else (the engine thread) None when no
        range is free at once or the write is not packed, and every byte goes out asynchronously
        (the engine thread never waits on the wire). A failure comes back inside the result (the
        engine thread never raises it): `_finish_started` raises it."""
        if push.staging is None or not self.staging.fits(push.staging[1]):
            return None
        rows = token_rows(src_blocks, push.first_block, num_tokens, self.cache.block_size)
        address, size = push.staging
        if size != message_bytes(self.cache, len(rows)):
            error = TransferFailed(f"the decode side lent {size} bytes for a {message_bytes(self.cache, len(rows))}"
                                   "-byte packed hand-off")
            return StartedPush(None, size, 0, error=error)
        offset = self.staging.borrow(size, push.deadline if wait else 0.0)
        if offset is None:
            return StartedPush(None, size, 0, error=TransferFailed(
                "the staging area stayed full until the hand-off's deadline")) if wait else None
        started = StartedPush(offset, size, payload_bytes(self.cache, len(rows)))
        gathering = [0.0]
        try:
            steps = _timed(pack_in_steps(self.cache, rows, slot, self.staging.buffer[offset:offset + size]), gathering)
            started.write = self.transport.start_chunks(push.dest.session, self.staging.address + offset, address,
                                                        size, steps, self.config.write_chunk_bytes, all_async=not wait)
        except Exception as e:  # its chunks have ended: the range is free again
            self.staging.give_back(offset, size)
            started.offset, started.error = None, e
        started.gather_s = gathering[0]
        return started

    def _start_direct(self, push: PushTo, segments: list[Segment]) -> "StartedPush":
        """Submit every segment straight into the decode side's pools as one asynchronous batch (the
        engine thread never waits on the wire); `_finish_started` waits for it and sends the notice."""
        started = StartedPush(None, 0, sum(s.nbytes for s in segments), packed=False)
        started.write = self.transport.start_segments(push.dest.session, segments)
        return started

    def _finish_started(self, push: PushTo, started: "StartedPush") -> tuple[int, int]:
        """Wait for a started write's chunks (packed) or batch (direct), then send its completion notice
        (`notices.py`) and free its range; (the request's bytes, writes)."""
        try:
            if started.error is not None:
                raise started.error
            with self._completion([push], packed=started.packed) as (notice, markers):
                writes = self.transport.finish(started.write, max(0.0, push.deadline - started.write.started),
                                               notice=notice, markers=markers)
            written = time.monotonic()
            self._add("seconds_packing", started.gather_s)
            self._add("seconds_writing", written - started.write.started - started.gather_s)
            if not started.packed:
                self._time_direct(started.write, written)
        finally:
            if started.offset is not None:
                self.staging.give_back(started.offset, started.size)
        return started.nbytes, writes

    @contextlib.contextmanager
    def _completion(self, pushes: list[PushTo], packed: bool) -> Iterator[tuple[str | None, list[Segment] | None]]:
        """How the decode side learns that these hand-offs' bytes are all in: (the transfer engine's
        notice, naming each hand-off whose decode side armed no marker; the completion markers of the
        others, `markers.py`), valid inside the block. A marker is one 8-byte write on a connection lane
        the data took, where the engine's notice opens a connection of its own to the peer each time."""
        marked = [p.marker for p in pushes if p.marker is not None]
        with self.marker_sources.segments(marked, packed) as markers:
            noticed = pushes if markers is None else [p for p in pushes if p.marker is None]
            yield "\n".join(n for p in noticed if (n := _notice(p.notice, packed)) is not None) or None, markers or None

    def _time_direct(self, write: ChunkedWrite, written: float) -> None:
        """A direct hand-off's write by phase: the engine thread's submission of its batch, the batch on
        the wire until the hand-off thread saw it complete (that thread's start included), then the
        notice's own write."""
        with self._lock:
            self._totals["seconds_submitting"] += write.submitted - write.started
            self._totals["seconds_transferring"] += write.completed - write.submitted
            self._totals["seconds_notifying"] += written - write.completed

    def _time_from_prefill(self, report: dict, landing: Landing) -> None:
        """Decode side, on the prefill server's host only (one monotonic clock, `clock.py`): the
        hand-off from the prefill's finish until the request's cache is in this engine's pools, and
        of that the notice (the prefill's last write returned -> this side starts scattering; below
        zero when the notice overtakes the prefill thread's own return from that write)."""
        if report.get("clock") is None or report.get("clock") != monotonic_clock_id():
            return
        with self._lock:
            self._totals["timed"] += 1
            self._totals["seconds_finish_to_cache"] += landing.cached - float(report["finished_at"])
            self._totals["seconds_notice"] += landing.unpacking - float(report["written_at"])
        self._busy.add(float(report["finished_at"]), landing.cached)

    def _add(self, total: str, amount: float) -> None:
        with self._lock:
            self._totals[total] += amount

    def _end(self, request_id: str, direction: str, nbytes: int = 0, seconds: float = 0.0,
             error: str | None = None, unpacked: bool = False) -> None:
        with self._lock:
            self._in_flight.discard(request_id)
            if error is not None:
                self._finished.failed[request_id] = error
                self._totals["failures"] += 1
            else:
                getattr(self._finished, direction).add(request_id)
                self._totals[direction] += 1
                self._totals[f"bytes_{direction}"] += nbytes
                self._totals[f"seconds_{direction}"] += seconds
                self._totals["unpacked"] += unpacked
        if self.on_transfer_end is not None:
            self.on_transfer_end()


@dataclass
class PendingPush:
    """Prefill side: a direct hand-off whose prefill the running step finished, written once the step ends."""

    request_id: str
    push: PushTo
    src_blocks: list[int]
    num_tokens: int
    slot: int
    segments: list[Segment]


@dataclass
class StartedPush:
    """Prefill side: a hand-off on its way: packed (gathered into this side's staging area, its chunks
    on their way) or direct (its segments on their way into the decode side's pools)."""

    offset: int | None  # of its range in this side's staging area (None: none held)
    size: int
    nbytes: int  # the request's bytes (`payload_bytes`)
    write: ChunkedWrite | None = None
    gather_s: float = 0.0
    error: Exception | None = None  # why it could not start (raised on the hand-off thread)
    packed: bool = True  # False: its segments go straight into the decode side's pools


def inline_groups(pending: list[PendingPush], max_bytes: int) -> list[list[PendingPush]]:
    """`pending` by peer, in order, each peer's split into runs of at most `max_bytes` (one write each)."""
    groups: list[list[PendingPush]] = []
    open_group: dict[str, tuple[list[PendingPush], int]] = {}  # peer -> its last group and that group's bytes
    for p in pending:
        peer, nbytes = p.push.dest.session, sum(s.nbytes for s in p.segments)
        group, total = open_group.get(peer, (None, 0))
        if group is None or total + nbytes > max_bytes:
            group, total = [], 0
            groups.append(group)
        group.append(p)
        open_group[peer] = (group, total + nbytes)
    return groups


def _notice(key: str | None, packed: bool) -> str | None:
    """The completion notice of a hand-off whose decode side named `key` (its watcher splits it again)."""
    return None if key is None else f"{key} {'packed' if packed else 'unpacked'}"


def _timed(steps: Iterator[int], spent: list[float]) -> Iterator[int]:
    """`steps`, adding the seconds spent inside it (not in whoever consumes it) to spent[0]."""
    while True:
        start = time.monotonic()
        try:
            value = next(steps)
        except StopIteration:
            spent[0] += time.monotonic() - start
            return
        spent[0] += time.monotonic() - start
        yield value


def push_target(connector: MooncakeConnector, payload: dict) -> tuple[list[int], PushTo]:
    """Check a decode server's hand-off request against this engine; (prompt ids, where to write).

    A different model, cache layout, dtype or block size is refused: raw bytes would be garbage."""
    try:
        dest = PoolDescriptor.from_json(payload["dest"])
        token_ids = [int(t) for t in payload["token_ids"]]
        first_block, dst_blocks = int(payload["first_block"]), [int(b) for b in payload["dst_blocks"]]
        dst_slot, timeout_s = int(payload["dst_slot"]), float(payload["timeout_s"])
        staging = (int(payload["staging"][0]), int(payload["staging"][1])) if payload.get("staging") else None
        notice = str(payload["notice"]) if payload.get("notice") is not None else None
        marker = (int(payload["marker"][0]), int(payload["marker"][1])) if payload.get("marker") else None
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(f"malformed hand-off request ({e!r})", field="kv_transfer") from e
    if dest.signature != connector.descriptor.signature:
        raise RequestError("the decode server runs a different model, weights, cache layout, dtype or block size "
                           f"(signature {dest.signature} != {connector.descriptor.signature})", field="kv_transfer")
    bs = connector.cache.block_size
    need = -(-(len(token_ids) - 1) // bs) - first_block
    if len(token_ids) < 2 or first_block < 0 or len(dst_blocks) != need:
        raise RequestError(f"{len(dst_blocks)} destination blocks for {len(token_ids) - 1} tokens from block "
                           f"{first_block} (expected {need})", field="kv_transfer")
    return token_ids, PushTo(dest=dest, first_block=first_block, dst_blocks=dst_blocks, dst_slot=dst_slot,
                             timeout_s=timeout_s, staging=staging, deadline=time.monotonic() + timeout_s, notice=notice,
                             marker=marker)
