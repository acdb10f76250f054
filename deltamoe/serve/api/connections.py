"""Connection-level limits for the HTTP server: what one slow or hostile client may hold.

uvicorn times out idle keep-alive connections only after a response; a client that connects
and then sends its request headers a byte at a time (or never) would hold a connection, and a
file descriptor, forever. `HeaderTimeoutH11` closes a connection whose request headers are
not complete within `header_timeout_s` of connecting or of the previous response. Concurrent
connections are bounded below the process's file limit (uvicorn answers 503 above it), and
when the limit is hit anyway (`EMFILE` in accept) the event loop logs one line a minute
instead of one traceback per refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("deltamoe.serve.api")

_FD_RESERVE = 64  # descriptors kept for the model, logs and the engine beyond client sockets


@dataclass(frozen=True)
class HTTPLimits:
    header_timeout_s: float = 10.0  # connect (or previous response) -> complete request headers
    keep_alive_s: int = 5  # idle keep-alive connection
    body_timeout_s: float = 60.0  # request headers -> complete body (read_body)
    max_header_bytes: int = 64 * 1024  # request line + headers
    max_connections: int | None = None  # None: the file limit minus a reserve, over sockets_per_connection
    sockets_per_connection: int = 1  # the router holds a second one per client: its decode server's


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard limit (servers need sockets); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may forbid it; the current limit stands
            pass
    return soft


def connection_limit(limits: HTTPLimits) -> int:
    if limits.max_connections is not None:
        return limits.max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, (min(soft, 1 << 16) - _FD_RESERVE) // limits.sockets_per_connection)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers."""

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._cancel_header_deadline()
            # A new RequestResponseCycle means the next request's headers arrived in time.
            waiting_for = self.cycle
            self._header_deadline = self.loop.call_later(timeout_s, self._header_deadline_passed, waiting_for)

        def _cancel_header_deadline(self) -> None:
            handle = getattr(self, "_header_deadline", None)
            if handle is not None:
                handle.cancel()
            self._header_deadline = None

        def _header_deadline_passed(self, waiting_for: Any) -> None:
            if self.cycle is waiting_for and not self.transport.is_closing():
                log.debug("closing %s: no complete request headers within %.0f s", self.client, timeout_s)
                self.transport.close()

    return HeaderTimeoutH11


def uvicorn_config(app: Any, host: str, port: int, log_level: str, limits: HTTPLimits = HTTPLimits(),
                   **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(limits.header_timeout_s), timeout_keep_alive=limits.keep_alive_s,
                          limit_concurrency=connection_limit(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
                          **kwargs)


class AcceptErrorLog:
    """An event-loop exception handler that reports "out of file descriptors" in accept as one line a
    minute (with how many were refused) and passes every other error to the previous handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float = 60.0):
        self.loop, self.every_s = loop, every_s
        self.previous = loop.get_exception_handler()
        self.count, self.last = 0, float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            exc = context.get("exception")
            log.warning("cannot accept connections: %s (%d times since the last notice); "
                        "lower the client count or raise the open-file limit", exc, self.count)
            self.count, self.last = 0, now

    def install(self) -> "AcceptErrorLog":
        self.loop.set_exception_handler(self)
        return self


class EndingServer(uvicorn.Server):
    """uvicorn, whose Ctrl-C / SIGTERM lets running requests finish for most of the grace period, then calls
    `end_all` (the server: end the engine's requests with a 503-style error; the router: close its relayed
    streams with an error event), before uvicorn would cancel them mid-response (a cut stream and a
    traceback in the log)."""

    def __init__(self, config: uvicorn.Config, end_all: Callable[[], None]):
        super().__init__(config)
        self.end_all = end_all

    async def shutdown(self, sockets=None) -> None:
        async def end_the_rest() -> None:
            await asyncio.sleep(max(self.config.timeout_graceful_shutdown - 1.0, 0.0))
            self.end_all()

        ending = asyncio.create_task(end_the_rest())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
