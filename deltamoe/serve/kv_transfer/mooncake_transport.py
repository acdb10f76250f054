"""The Mooncake transfer engine as this package uses it: one engine per server, pools registered once.

`TransferEngine.initialize(host, "P2PHANDSHAKE", "tcp", "")` needs no metadata server: peers
exchange segment descriptors on first contact, and each engine picks a free RPC port of its
own (two servers on one host never collide). Memory is registered on both sides (the TCP
transport requires it), once, at start-up: the whole cache pools, never per request. Writes are
submitted together and polled against a deadline, so a dead or slow peer ends in a bounded
time with an error instead of a hang.
"""

from __future__ import annotations

import os
import threading
import time

from deltamoe.errors import ConfigError
from deltamoe.serve.kv_transfer.pools import Segment

POLL_S = 0.0001
SPIN_S = 0.002  # first poll without a timer sleep: a small hand-off is done in well under a millisecond


class TransferFailed(RuntimeError):
    """A hand-off write that failed or ran past its deadline."""


class MooncakeTransport:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        os.environ.setdefault("GLOG_minloglevel", "2")  # the engine logs every handshake at INFO level
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # also a missing libibverbs.so.1 (apt-get install libibverbs1)
            raise ConfigError(f"the Mooncake transfer engine cannot be loaded ({e})", field="kv_transfer",
                              hint="pip install mooncake-transfer-engine-non-cuda; apt-get install -y libibverbs1")
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise ConfigError(f"the Mooncake transfer engine cannot start on {host!r} over {protocol}",
                              field="kv_transfer_host")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()  # submissions from several hand-off threads

    def register(self, address: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        if self._engine.register_memory(address, nbytes) != 0:
            raise ConfigError(f"cannot register {nbytes} bytes with the Mooncake transfer engine", field="kv_transfer")
        self._registered.append(address)

    def write(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        """Copy every segment into `peer`'s registered memory; raises TransferFailed (bounded by timeout_s)."""
        deadline = time.monotonic() + timeout_s
        handles = []
        with self._lock:
            for seg in segments:
                handle = self._engine.transfer_submit_write(peer, seg.src, seg.dst, seg.nbytes)
                if handle <= 0:
                    raise TransferFailed(f"the transfer engine refused a write to {peer} (peer unreachable?)")
                handles.append(handle)
        pending = list(handles)
        spin_until = time.monotonic() + SPIN_S
        while pending:
            still = []
            for handle in pending:
                status = self._engine.transfer_check_status(handle)
                if status < 0:
                    raise TransferFailed(f"a write of the hand-off to {peer} failed (status {status})")
                if status == 0:
                    still.append(handle)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise TransferFailed(f"the hand-off to {peer} took longer than {timeout_s:.1f} s "
                                         f"({len(pending)} of {len(handles)} writes unfinished)")
                time.sleep(0 if time.monotonic() < spin_until else POLL_S)

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
