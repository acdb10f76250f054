"""A request's body, read within the server's limits: its size (413) and its time (408)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from deltamoe.serve.api.connections import HTTPLimits
from deltamoe.serve.api.errors import APIError, from_validation_error

MAX_BODY_BYTES = 32 * 2**20  # far above any prompt that fits a context; stops a client from filling memory
R = TypeVar("R", bound=BaseModel)


async def read_body(request: Request, schema: type[R], limit: int = MAX_BODY_BYTES,
                    timeout_s: float = HTTPLimits.body_timeout_s) -> R:
    """The body as `schema`, or a 4xx: those of `read_bytes`, or not UTF-8 / not JSON / wrong types (400)."""
    body = await read_bytes(request, limit, timeout_s)
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


async def read_bytes(request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float = HTTPLimits.body_timeout_s) -> bytes:
    """The body's bytes, or a 4xx: too large (413), not complete within `timeout_s` (408), or the client
    hung up while sending it (499, nginx's "client closed request": counted as the client's doing, not
    a server error)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection while sending the body",
                       code="client_closed_request") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:.0f} s",
                       code="request_timeout") from None
    return b"".join(chunks)
