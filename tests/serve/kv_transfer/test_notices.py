"""NoticeWatcher: a notice runs its hand-off's callback with its detail, once; whoever claims a
hand-off first handles it (a claimed one's notice is dropped, and so is one nobody expects); the
watcher polls only while some hand-off awaits its notice."""

from __future__ import annotations

import threading
import time

from deltamoe.serve.kv_transfer.notices import NoticeWatcher


def test_notices_run_their_callback_once_and_claims_win_over_late_notices():
    queued: list[str] = []
    lock = threading.Lock()
    seen: list[tuple[str, str]] = []

    def poll() -> list[str]:
        with lock:
            got = queued[:]
            queued.clear()
        return got

    watcher = NoticeWatcher(poll, poll_s=1e-4)
    try:
        watcher.expect("a", lambda detail: seen.append(("a", detail)))
        watcher.expect("b", lambda detail: seen.append(("b", detail)))
        with lock:
            queued.extend(["stranger packed", "a packed"])
        deadline = time.monotonic() + 5.0
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen == [("a", "packed")]
        assert not watcher.claim("a")  # its callback ran: the notice's side handled it
        assert watcher.claim("b")  # no notice yet: the claimer handles it
        with lock:  # late notices of claimed hand-offs are dropped when the watcher next polls
            queued.extend(["b unpacked", "a packed", "c unpacked"])
        time.sleep(0.02)
        assert len(queued) == 3  # nothing awaited: no polls
        watcher.expect("c", lambda detail: seen.append(("c", detail)))
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen == [("a", "packed"), ("c", "unpacked")] and not queued
    finally:
        watcher.close()


def test_one_notice_can_name_several_handoffs():
    queued = ["k1 unpacked\nk2 packed\nstranger unpacked"]
    seen: list[tuple[str, str]] = []
    watcher = NoticeWatcher(lambda: [queued.pop()] if queued else [], poll_s=1e-4)
    try:
        for key in ("k1", "k2"):
            watcher.expect(key, lambda detail, key=key: seen.append((key, detail)))
        deadline = time.monotonic() + 5.0
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen == [("k1", "unpacked"), ("k2", "packed")]
        assert not watcher.claim("k1") and not watcher.claim("k2")
    finally:
        watcher.close()
