"""The prefill side's small direct hand-offs of one step: those to one peer are written inline together
(one synchronous call, one notice naming each, up to `inline_write_bytes` a call); when the transport
is busy they are all put on their way before any of their notices is sent; each is answered with its
own report, and one that cannot start fails alone (a fake transport records the calls)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from deltamoe.serve.kv_transfer.mooncake_connector import HandOffConfig, MooncakeConnector, PendingPush, PushTo
from deltamoe.serve.kv_transfer.mooncake_transport import ChunkedWrite, TransferFailed
from deltamoe.serve.kv_transfer.pools import PoolDescriptor, Segment


class RecordingTransport:
    """Records the calls; `finish` (a hand-off thread's wait for a batch, then its notice) first waits
    until `starts` batches were started: a connector that waits for one hand-off's notice before it
    starts the next stalls there."""

    lanes = True

    def __init__(self, starts: int = 1, fail_peer: str | None = None, busy: bool = False):
        self.calls: list[tuple[str, str | None]] = []
        self.starts, self.fail_peer, self.busy = starts, fail_peer, busy
        self.changed = threading.Condition()

    def write_unless_busy(self, peer, segments, timeout_s, notice=None, markers=None) -> bool:
        if self.busy:
            return False
        with self.changed:
            self.calls.append(("inline", f"{len(segments)} segments: {notice}" + _markers(markers)))
        return True

    def start_segments(self, peer, segments) -> ChunkedWrite:
        if peer == self.fail_peer:
            raise TransferFailed(f"cannot submit to {peer}")
        with self.changed:
            self.calls.append(("start", None))
            self.changed.notify_all()
        write = ChunkedWrite(peer, segments[-1].src, segments[-1].dst, segments[-1].nbytes, time.monotonic())
        write.submitted = write.completed = time.monotonic()
        return write

    def finish(self, write, timeout_s, notice=None, markers=None) -> int:
        with self.changed:
            if not self.changed.wait_for(lambda: sum(k == "start" for k, _ in self.calls) >= self.starts, 5.0):
                raise TransferFailed("a notice waited for batches that were not started")
            self.calls.append(("notice", notice + _markers(markers) if notice else _markers(markers)))
        return 2


def _markers(markers: list[Segment] | None) -> str:
    """The markers' values as the transport would write them (read from their registered source words)."""
    if not markers:
        return ""
    return " + markers " + ",".join(f"{ctypes.c_int64.from_address(m.src).value}@{m.dst}" for m in markers)


def pending(i: int, peer: str = "peer:1", marker: tuple[int, int] | None = None) -> PendingPush:
    push = PushTo(dest=PoolDescriptor(peer, {}, "sig"), first_block=0, dst_blocks=[i], dst_slot=i, timeout_s=30.0,
                  deadline=time.monotonic() + 30.0, notice=f"key-{i}", finished_at=time.monotonic(), marker=marker)
    return PendingPush(f"r{i}", push, [i], 3, i, [Segment(1000 * i, 2000 * i, 64)])


def connector_with(transport: RecordingTransport, inline_write_bytes: int = 2 << 20) -> MooncakeConnector:
    connector = MooncakeConnector(HandOffConfig(inline_write_bytes=inline_write_bytes))
    connector.transport = transport
    return connector


def test_one_handoff_of_a_step_is_written_inline():
    transport = RecordingTransport()
    connector = connector_with(transport)
    alone = pending(0)
    connector._step_pushes = [alone]
    connector.step_ended()
    assert transport.calls == [("inline", "1 segments: key-0 unpacked")] and connector._step_pushes == []
    assert alone.push.done.result(timeout=10.0)["segments"] == 1  # one synchronous call, notice included
    assert connector.get_finished().sent == {"r0"}


def test_a_steps_handoffs_to_one_peer_are_one_call_with_one_notice_naming_each():
    transport = RecordingTransport()
    connector = connector_with(transport, inline_write_bytes=3 * 64)  # three hand-offs of 64 bytes a call
    pushes = [pending(i, peer=f"peer:{i % 2}") for i in range(8)]  # even ones to peer:0, odd ones to peer:1
    connector._step_pushes = list(pushes)
    connector.step_ended()
    notices = lambda ids: "\n".join(f"key-{i} unpacked" for i in ids)  # noqa: E731
    assert transport.calls == [("inline", f"3 segments: {notices([0, 2, 4])}"),
                               ("inline", f"3 segments: {notices([1, 3, 5])}"),
                               ("inline", f"1 segments: {notices([6])}"), ("inline", f"1 segments: {notices([7])}")]
    assert all(p.push.done.result(timeout=10.0)["bytes"] == 64 for p in pushes)
    stats = connector.stats()
    assert stats["kv_transfer_written_inline"] == stats["kv_transfer_sent"] == 8


def test_busy_transport_several_handoffs_all_start_before_any_notice():
    transport = RecordingTransport(starts=4, busy=True)
    connector = connector_with(transport)
    pushes = [pending(i) for i in range(4)]
    connector._step_pushes = list(pushes)
    connector.step_ended()
    reports = [p.push.done.result(timeout=10.0) for p in pushes]
    assert [kind for kind, _ in transport.calls] == ["start"] * 4 + ["notice"] * 4
    assert sorted(n for _, n in transport.calls[4:]) == [f"key-{i} unpacked" for i in range(4)]
    assert all(r["bytes"] == 64 and r["segments"] == 2 and not r["packed"] for r in reports)
    connector._threads.shutdown(wait=True)
    assert connector.get_finished().sent == {f"r{i}" for i in range(4)}


def test_a_handoff_that_cannot_start_fails_alone():
    transport = RecordingTransport(starts=1, fail_peer="dead:1", busy=True)
    connector = connector_with(transport)
    good, bad = pending(0), pending(1, peer="dead:1")
    connector._step_pushes = [good, bad]
    connector.step_ended()
    assert good.push.done.result(timeout=10.0)["bytes"] == 64
    with pytest.raises(TransferFailed, match="cannot submit"):
        bad.push.done.result(timeout=10.0)
    connector._threads.shutdown(wait=True)
    finished = connector.get_finished()
    assert finished.sent == {"r0"} and set(finished.failed) == {"r1"}


def test_handoffs_with_a_marker_are_told_by_it_the_others_by_the_notice():
    """A decode side that armed a completion marker gets it written after the step's batch (value, at
    its address); one that did not is named in the engine's notice, as before; both in one call."""
    transport = RecordingTransport()
    connector = connector_with(transport)
    marked, plain = pending(0, marker=(4096, 12)), pending(1)
    connector._step_pushes = [marked, plain]
    connector.step_ended()
    assert transport.calls == [("inline", "2 segments: key-1 unpacked + markers 12@4096")]
    assert marked.push.done.result(timeout=10.0)["segments"] == 2  # the batch, then the marker's write


def test_a_started_handoffs_marker_says_packed_with_its_value_plus_one():
    transport = RecordingTransport(busy=True)
    connector = connector_with(transport)
    marked = pending(0, marker=(4096, 12))
    connector._step_pushes = [marked]
    connector.step_ended()
    marked.push.done.result(timeout=10.0)
    assert transport.calls == [("start", None), ("notice", " + markers 12@4096")]  # a direct one: unpacked
    with connector._completion([marked.push], packed=True) as (notice, markers):
        assert notice is None and _markers(markers) == " + markers 13@4096"
