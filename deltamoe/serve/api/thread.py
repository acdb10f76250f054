"""Serve an app from a background thread of this process: for tests, notebooks and in-process rollouts.

uvicorn owns the thread's event loop; port 0 lets the OS pick a free port, read back from the
bound socket, so parallel test runs never collide.
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from deltamoe.serve.api.connections import HTTPLimits, uvicorn_config


class ServerThread:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: HTTPLimits = HTTPLimits()):
        self.host = host
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level, limits))
        self._thread = threading.Thread(target=self.server.run, name="deltamoe-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host} within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
