"""Settings for every test process.

The default suite runs under pytest-xdist with one worker per core (pyproject addopts): each
worker gets its share of the cores for torch's threads, so the workers together never start
more threads than there are cores (a subprocess a test starts picks its own, by deltamoe's
thread policy).

`generate` and `serve` compile their decode step by default; the suite's commands (and the
servers tests start as subprocesses, which inherit the environment) decode eagerly unless a test
asks for --compile: a first compile takes a minute or more per model on two cores."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

os.environ.setdefault("DELTAMOE_COMPILE_DEFAULT", "0")


def pytest_configure(config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@contextlib.contextmanager
def _serve_process(args: list[str], up_within_s: float = 120.0):
    """`python -m deltamoe serve ARGS --port <free>` (one torch thread), healthy: yields (process, url).
    Its stderr is a pipe (read it after stopping it); killed if the test leaves it running."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "deltamoe", "serve", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + up_within_s
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up in {up_within_s:g} s"
            time.sleep(0.3)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def serve_process():
    """`with serve_process([...serve args]) as (proc, url):` a real `deltamoe serve` on a free port."""
    return _serve_process
