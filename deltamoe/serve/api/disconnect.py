"""Waiting on work for a client that may leave: the server's non-streamed generations and the
router's non-streamed relays poll `request.is_disconnected()` and cancel the work when it is gone
(Starlette watches for a disconnect only while a streaming response is being sent)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
CLIENT_CLOSED = 499  # nginx's "client closed request": only the access log and /metrics ever see it


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
