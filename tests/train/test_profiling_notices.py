"""The profiler's native start/stop notices are dropped; everything else on stderr passes through."""

from __future__ import annotations

import os

from deltamoe.train.profiling import _without_kineto_notices


def test_only_kineto_notices_are_dropped_from_stderr(capfd) -> None:
    with _without_kineto_notices():
        os.write(2, b"USDT:2026-11-30 12:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err == "a real warning\nafter\n"
