"""`MooncakeTransport.write_as_ready`: bytes written in chunks while the sender still produces the
rest land exactly where a single write would put them; an unreachable peer or a failing producer
ends the call with an error, and only once no chunk is in flight; the engine's log follows
GLOG_minloglevel."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mooncake.engine")

from deltamoe.serve.kv_transfer.mooncake_transport import (  # noqa: E402
    MooncakeTransport, TransferFailed, engine_log_level, quiet_engine_logs)


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

    writes = sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), ready(), 4000, 5.0)
    assert produced == [1000, 2000, 4000, 9000, 12000, 16384]
    assert writes == 3  # [0, 4000), [4000, 9000), [9000, 16384)
    assert torch.equal(dst, src)


def test_a_failing_producer_raises_after_its_chunks_have_landed(peers):
    sender, receiver, src, dst = peers
    dst.zero_()

    def ready():
        yield 8192
        raise ValueError("gather failed")

    with pytest.raises(ValueError, match="gather failed"):
        sender.write_as_ready(receiver.session, src.data_ptr(), dst.data_ptr(), ready(), 4096, 5.0)
    assert torch.equal(dst[:2048], src[:2048]) and not dst[2048:].any()


def test_an_unreachable_peer_is_a_transfer_failure(peers):
    sender, _, src, _ = peers
    with pytest.raises(TransferFailed, match="127.0.0.1:1"):
        sender.write_as_ready("127.0.0.1:1", src.data_ptr(), 0, iter([1024]), 512, 5.0)


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
