"""`MooncakeTransport.write_as_ready`: bytes written in chunks while the sender still produces the
rest land exactly where a single write would put them; an unreachable peer, a failing producer or
a chunk the peer refuses ends the call with an error, and only once no chunk is in flight (a late
sibling never lands in memory the caller has lent out again); a completion notice reaches the peer
once every byte is there; the engine's log follows GLOG_minloglevel."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mooncake.engine")

import os  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402

from deltamoe.serve.kv_transfer.mooncake_transport import (  # noqa: E402
    MooncakeTransport, TransferFailed, engine_log_level, quiet_engine_logs)
from deltamoe.serve.kv_transfer.pools import Segment  # noqa: E402


@pytest.fixture(scope="module")
def peers():
    sender, receiver = MooncakeTransport(timeout_s=5.0), MooncakeTransport(timeout_s=5.0)
    src, dst = torch.arange(4096, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32)
    sender.register(src.data_ptr(), src.nbytes)
    receiver.register(dst.data_ptr(), dst.nbytes)
    yield sender, receiver, src, dst
    sender.close()
    receiver.close()


def test_chunks_go_out_as_bytes_become_ready_and_land_in_place(peers):
    sender, receiver, src, dst = peers
    dst.zero_()
    produced = []

    def ready():  # the producer's progress in bytes; writes of >= 4000 new bytes go out meanwhile
        for end in (1000, 2000, 4000, 9000, 12000, 16384):
            produced.append(end)
            yield end

    writes = sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), 16384, ready(), 4000, 5.0)
    assert produced == [1000, 2000, 4000, 9000, 12000, 16384]
    assert writes == 3  # [0, 4000), [4000, 9000), [9000, 16384) (the last once produced)
    assert torch.equal(dst, src)


def test_a_failing_producer_raises_after_its_chunks_have_landed(peers):
    sender, receiver, src, dst = peers
    dst.zero_()

    def ready():
        yield 8192
        raise ValueError("gather failed")

    with pytest.raises(ValueError, match="gather failed"):
        sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), 16384, ready(), 4096, 5.0)
    assert torch.equal(dst[:2048], src[:2048]) and not dst[2048:].any()


def wait_for_notices(transport: MooncakeTransport, count: int, timeout_s: float = 5.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += transport.notices()
        time.sleep(0.001)
    return got


def test_a_notice_reaches_the_peer_after_the_last_chunk(peers):
    sender, receiver, src, dst = peers
    receiver.notices()  # nothing left over from other tests
    dst.zero_()
    writes = sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), 16384,
                                   iter([4096, 8192, 16384]), 4096, 5.0, notice="t1")
    assert writes == 4 and wait_for_notices(receiver, 1) == ["t1"] and torch.equal(dst, src)  # 3 chunks + the notice
    # A single write (no chunk reached 4096 bytes before the end) carries the notice as well.
    dst.zero_()
    writes = sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), 16384, iter([16384]), 4096, 5.0,
                                   notice="t2")
    assert writes == 1 and wait_for_notices(receiver, 1) == ["t2"] and torch.equal(dst, src)
    # Segments straight into the peer's memory in one batch, which carries the notice.
    dst.zero_()
    segments = [Segment(src.data_ptr() + i, dst.data_ptr() + i, 4096) for i in (0, 8192, 4096, 12288)]
    sender.write(receiver.session, segments, 5.0, notice="t3")
    assert wait_for_notices(receiver, 1) == ["t3"] and torch.equal(dst, src)
    # The same segments as one asynchronous batch (`start_segments`, the engine thread's form), then
    # `finish` waits for it and sends the notice on a write of the last segment's tail again.
    dst.zero_()
    write = sender.start_segments(receiver.session, segments)
    assert sender.finish(write, 5.0, notice="t4") == 2
    assert wait_for_notices(receiver, 1) == ["t4"] and torch.equal(dst, src)
    sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), 16384, iter([16384]), 4096, 5.0)
    assert wait_for_notices(receiver, 1, timeout_s=0.2) == []  # no notice asked, none sent


def test_write_unless_busy_writes_with_its_notice_or_leaves_everything_untouched(peers):
    """The prefill engine thread's form: one synchronous batch carrying its notice, unless another thread
    waits on the transport (then False at once, nothing written, no notice)."""
    sender, receiver, src, dst = peers
    receiver.notices()
    segments = [Segment(src.data_ptr() + i, dst.data_ptr() + i, 4096) for i in (4096, 0, 12288, 8192)]
    dst.zero_()
    with sender._waiter:  # another thread waits on the engine now
        start = time.monotonic()
        assert not sender.write_unless_busy(receiver.session, segments, 5.0, notice="busy")
        assert time.monotonic() - start < 0.04  # never waits for the lock (its patience is 50 ms)
    assert wait_for_notices(receiver, 1, timeout_s=0.2) == [] and not dst.any()
    assert sender.write_unless_busy(receiver.session, segments, 5.0, notice="t5")
    assert wait_for_notices(receiver, 1) == ["t5"] and torch.equal(dst, src)
    # A step's hand-offs to one peer in one call: its one notice names each of them, a line each.
    many = "\n".join(f"{secrets.token_hex(4)}-{i} unpacked" for i in range(16))
    assert sender.write_unless_busy(receiver.session, segments, 5.0, notice=many)
    assert wait_for_notices(receiver, 1) == [many]
    with pytest.raises(TransferFailed, match="127.0.0.1:1"):
        sender.write_unless_busy("127.0.0.1:1", segments, 5.0, notice="never")
    assert not sender._waiter.locked()


def test_a_refused_chunk_fails_the_write_only_once_its_siblings_have_landed(peers):
    """The peer refuses the second chunk (it lies past its registered memory) while the first, large
    one is still on its way: the call raises only after that one landed, and sends no notice."""
    sender, receiver, *_ = peers
    big = 16 << 20
    src = torch.full((big + 8192,), 7, dtype=torch.uint8)
    dst = torch.zeros(big + 8192, dtype=torch.uint8)
    sender.register(src.data_ptr(), src.numel())
    receiver.register(dst.data_ptr(), big)  # the first chunk's range only
    with pytest.raises(TransferFailed, match="failed"):
        sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), big + 8192,
                              iter([big, big + 4096, big + 8192]), 4096, 5.0, notice="never")
    assert int(dst[big - 1]) == 7  # the large sibling had landed before the call returned
    assert torch.equal(dst[:big], src[:big]) and not dst[big:].any()
    assert wait_for_notices(receiver, 1, timeout_s=0.2) == []


def test_an_unreachable_peer_is_a_transfer_failure(peers):
    sender, _, src, _ = peers
    with pytest.raises(TransferFailed, match="127.0.0.1:1"):
        sender.write_as_ready("127.0.0.1:1", src.data_ptr(), 0, 1024, iter([1024]), 512, 5.0)


def test_engine_logs_follow_glog_minloglevel_default_error(peers, monkeypatch):
    """The bundled glog ignores the variable by itself (it logged a line per batch at INFO)."""
    level = engine_log_level()
    if level is None:
        pytest.skip("this Mooncake wheel has no separate glog library")
    monkeypatch.delenv("GLOG_minloglevel", raising=False)
    quiet_engine_logs()
    assert level.value == 2
    monkeypatch.setenv("GLOG_minloglevel", "1")
    quiet_engine_logs()
    assert level.value == 1
    monkeypatch.delenv("GLOG_minloglevel")
    quiet_engine_logs()


@pytest.mark.parametrize("lanes", [None, "0"])
def test_segments_land_in_place_over_connection_lanes_or_a_connection_each(peers, monkeypatch, lanes):
    """The transport turns the engine's connection lanes on unless the variable says otherwise, and a
    batch of segments with a notice lands intact either way."""
    from deltamoe.serve.kv_transfer.mooncake_transport import CONNECTION_LANES

    _, receiver, src, dst = peers
    receiver.notices()  # nothing left over from other tests
    if lanes is None:
        monkeypatch.delenv(CONNECTION_LANES, raising=False)
    else:
        monkeypatch.setenv(CONNECTION_LANES, lanes)
    sender = MooncakeTransport(timeout_s=5.0)
    try:
        assert os.environ[CONNECTION_LANES] == (lanes or "1")
        sender.register(src.data_ptr(), src.nbytes)
        dst.zero_()
        segments = [Segment(src.data_ptr() + i * 1024, dst.data_ptr() + i * 1024, 1024) for i in range(16)]
        for _ in range(2):  # the second batch reuses the lanes the first one opened
            dst.zero_()
            sender.write(receiver.session, segments, 5.0, notice=f"lanes-{lanes}")
            assert torch.equal(dst, src)
            assert wait_for_notices(receiver, 1, timeout_s=10.0) == [f"lanes-{lanes}"]  # returns on arrival
    finally:
        sender.close()


def test_the_engines_start_writes_no_false_error_but_real_lines_still_show(capfd):
    """The P2PHANDSHAKE start logged "E... Local segment descriptor not found" at every server start
    (no error: hand-offs then work); other lines written while the engine starts are kept."""
    from deltamoe.serve.kv_transfer.mooncake_transport import engine_start_log_filtered

    capfd.readouterr()
    MooncakeTransport(timeout_s=5.0).close()
    assert "Local segment descriptor not found" not in capfd.readouterr().err
    with engine_start_log_filtered():
        os.write(2, b"E1204 transfer_metadata.cpp:1098] Local segment descriptor not found\n"
                    b"E1204 rpc.cpp:1] a real problem\n")
    assert capfd.readouterr().err == "E1204 rpc.cpp:1] a real problem\n"
