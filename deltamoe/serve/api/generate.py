"""One generation request, from the engine's first output to the last byte on the wire.

The first output is awaited before any header is sent: the engine validates (and may refuse)
a request only when its stream is first read, and a refusal must be a 4xx, not a broken
stream. After that, streaming sends one SSE event per chunk and `data: [DONE]`; non-streaming
collects into one JSON body. Either way, a client that goes away aborts the engine request,
which frees its cache blocks and state slot: streaming through Starlette's disconnect watch
(it cancels the body iterator, and the response's background task closes it), non-streaming
by polling `request.is_disconnected()` while waiting.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from deltamoe.errors import RequestError
from deltamoe.serve.api.disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from deltamoe.serve.api.errors import APIError, from_request_error
from deltamoe.serve.api.metrics import RequestTiming, ServerMetrics
from deltamoe.serve.api.params import rename
from deltamoe.serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from deltamoe.serve.engine.outputs import RequestOutput
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.vision.preprocess import PreparedImage



class Formatter(Protocol):
    id: str
    last: RequestOutput | None

    def add(self, out: RequestOutput) -> BaseModel | None: ...

    def usage_chunk(self) -> BaseModel: ...

    def response(self) -> BaseModel: ...


def _engine_failed(e: EngineDeadError) -> APIError:
    code = {503: "model_unavailable", 400: "invalid_value"}.get(e.status, "engine_error")
    return APIError(e.status, str(e), code=code)


class Generation:
    """Runs one request against the engine and answers it (see the module docstring)."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, field_names: dict[str, str],
                 continuous_usage: bool = False):
        self.engine, self.metrics, self.field_names = engine, metrics, field_names
        self.continuous_usage = continuous_usage  # stream_options.continuous_usage_stats: usage on every chunk

    async def respond(self, request: Request, prompt: str | list[int], params: SamplingParams, fmt: Formatter,
                      stream: bool, include_usage: bool, kv_transfer: object | None = None,
                      images: list[PreparedImage] | None = None) -> Response:
        timing = RequestTiming()
        outputs = self.engine.generate(prompt, params, request_id=fmt.id, kv_transfer=kv_transfer, images=images)
        # Each failure below has already ended the engine's generator (the error or the
        # cancellation ran through it), so there is nothing left to close.
        try:
            first = await unless_disconnected(request, outputs.__anext__())
        except RequestError as e:
            raise from_request_error(rename(e, self.field_names)) from e
        except EngineDeadError as e:
            raise _engine_failed(e) from e
        except ClientGone:
            self.metrics.observe(timing, "abort")
            return Response(status_code=CLIENT_CLOSED)
        timing.tokens(len(first.delta_token_ids))
        if stream:
            events = self._events(first, outputs, fmt, timing, include_usage)
            # The background task runs even after a disconnect cancelled the stream: closing the
            # iterator then aborts the engine request at once instead of at garbage collection.
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, first, outputs, fmt, timing)

    async def _collect(self, request: Request, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                       fmt: Formatter, timing: RequestTiming) -> Response:
        async def drain() -> None:
            out = first
            fmt.add(out)
            while not out.finished:
                out = await outputs.__anext__()
                timing.tokens(len(out.delta_token_ids))
                fmt.add(out)

        reason = "abort"
        try:
            await unless_disconnected(request, drain())
            reason = fmt.last.finish_reason or "abort"
        except EngineDeadError as e:
            reason = "error"
            raise _engine_failed(e) from e
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            timing.end = time.perf_counter()
            self.metrics.observe(timing, reason)
            await outputs.aclose()
        return JSONResponse(fmt.response().model_dump())

    async def _events(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput], fmt: Formatter,
                      timing: RequestTiming, include_usage: bool) -> AsyncIterator[str]:
        reason = "abort"
        try:
            out = first
            while True:
                chunk = fmt.add(out)
                if chunk is not None and self.continuous_usage:
                    chunk.usage = fmt.usage_chunk().usage
                if chunk is not None:
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if out.finished:
                    reason = out.finish_reason or "abort"
                    break
                out = await outputs.__anext__()
                timing.tokens(len(out.delta_token_ids))
            if include_usage:
                yield f"data: {fmt.usage_chunk().model_dump_json()}\n\n"
        except EngineDeadError as e:  # headers are gone already: report in-band, as OpenAI does
            reason = "error"
            yield f"data: {json.dumps(_engine_failed(e).body())}\n\n"
        finally:
            if timing.end is None:
                timing.end = time.perf_counter()
                self.metrics.observe(timing, reason)
            await outputs.aclose()
        yield "data: [DONE]\n\n"
