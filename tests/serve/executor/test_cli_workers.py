"""`deltamoe generate|serve --tp/--ep`: the ranks start from the command itself or from torchrun, give the
one-process tokens, and leave no process behind; a killed worker makes the server answer 503."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltamoe.cli import main

GENERATE = ["-m", "deltamoe", "generate", "tiny", "-p", "hello there", "--max-tokens", "6", "--temperature", "0",
            "--cache-memory", "16MiB"]


def _run(args: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def one_process_text() -> str:
    return _run(GENERATE)


@pytest.mark.slow
def test_generate_with_ep2_spawns_its_workers(one_process_text):
    assert _run(GENERATE + ["--ep", "2"]) == one_process_text


@pytest.mark.slow
def test_generate_with_tp2_compiled(one_process_text):
    assert _run(GENERATE + ["--tp", "2", "--compile"]) == one_process_text


@pytest.mark.slow
def test_generate_under_torchrun(one_process_text):
    """torchrun --standalone picks its own free port; rank 1 runs the worker loop and prints nothing."""
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *GENERATE[1:], "--ep", "2"])
    assert out == one_process_text


def test_bad_layout_is_a_usage_error(capsys):
    assert main(["generate", "tiny", "-p", "x", "--tp", "3"]) == 2
    assert "tp" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ServeEp2:
    """`deltamoe serve tiny --ep 2` in a subprocess, up and healthy on a free port; killed if a test leaves it."""

    def __enter__(self) -> "ServeEp2":
        import httpx

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "deltamoe", "serve", "tiny", "--port", str(port),
                                      "--ep", "2", "--threads", "1", "--cache-memory", "16MiB", "--log-level", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 180 s"
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> str:
        """SIGTERM, as a service manager stops it; its stderr."""
        self.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit status -SIGTERM)
        assert self.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        return self.proc.stderr.read().decode()


def test_serve_with_workers_turns_503_when_one_dies():
    import httpx

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
    with ServeEp2() as server:
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=180).status_code == 200  # a busy host: minutes
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after a worker died"
            time.sleep(0.2)
        assert "worker rank 1 exited with code -9" in health.json()["error"]["message"]
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 503 and "worker rank 1 exited" in answer.json()["error"]["message"]
        assert "the model workers are down: worker rank 1 exited with code -9" in server.stop()  # logged once


def test_serve_sigterm_stops_the_workers():
    with ServeEp2() as server:
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        assert "Traceback" not in server.stop()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "a worker outlived the server"
            time.sleep(0.1)
