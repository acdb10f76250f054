"""Forwarding one OpenAI request through a prefill/decode pair, with retries on a dead worker.

The router sends the client's body unchanged to a decode server, naming the prefill server in
the `X-DeltaMoE-Prefill-Url` header; the decode server has that prefill server compute the
prompt and hand it over, then streams the answer, which the router passes on.

Faults: a worker that cannot be reached, answers 5xx, or breaks a stream off is blamed and sits
out a while; the request is tried again on another pair, at most `max_retries` times. A decode
server's "prefill hand-off ... failed" blames the prefill server, unless a fresh poll of the pair
shows the decode server is the one that no longer matches the others (`workers.py`). Before the
first byte reaches the client a retry is always safe. Mid-stream, a retry is only exact when
the output is deterministic (temperature 0 or a seed): the new stream's events already sent are
skipped and its ids rewritten to the first stream's. Otherwise the client gets an in-band error
event, never a cut-off stream that looks complete. An in-band error that is the client's fault
(`invalid_request_error`, e.g. its grammar failed mid-way) reaches the client as the decode
server wrote it: nobody is blamed and nothing is retried.

Time: a decode server answers (even its headers) only once the prompt is computed and handed
over, and a non-streamed answer only once the whole generation is done, so the wait for those is
not bounded by a clock but by the worker's liveness: it ends when the worker fails
`UNRESPONSIVE_POLLS` of the router's polls in a row. Between two events of a stream the wait is
bounded by `read_timeout_s` as well.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltamoe.serve.api.disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from deltamoe.serve.kv_transfer.roles import PREFILL_HEADER
from deltamoe.serve.router.metrics import RouterMetrics
from deltamoe.serve.router.workers import UNRESPONSIVE_POLLS, Worker, WorkerPool

WATCH_S = 0.5  # how often a request waiting on a worker looks at the worker's poll record
# A request's own timeouts: no read timeout, since a worker's first bytes come only after its prefill
# (or, not streamed, its whole generation); `watched` bounds those waits instead.
REQUEST_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0)


class StreamBroken(Exception):
    pass


class WorkerUnresponsive(Exception):
    """The worker a request waits on has failed the router's polls `UNRESPONSIVE_POLLS` times in a row."""


async def watched(worker: Worker, awaitable):
    """The result of `awaitable`, unless `worker` stops answering the router's polls first (or the
    caller is cancelled: its client left)."""
    task = asyncio.ensure_future(awaitable)
    returned = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_S)
            if done:
                returned = True
                return task.result()
            if worker.unresponsive:
                raise WorkerUnresponsive(f"it failed the router's last {UNRESPONSIVE_POLLS} health polls")
    finally:
        if not returned:  # abandoned: cancelled, or its outcome dropped once it lands
            task.cancel()
            task.add_done_callback(_drop)


def _drop(task: asyncio.Future) -> None:
    """An abandoned wait's outcome: its error read (never logged as "never retrieved"), a response
    that arrived anyway closed (its connection back in the pool)."""
    if task.cancelled() or task.exception() is not None:
        return
    if isinstance(task.result(), httpx.Response):
        asyncio.ensure_future(task.result().aclose())


async def _next_line(lines: AsyncIterator[str]) -> str | None:
    try:
        return await lines.__anext__()
    except StopAsyncIteration:
        return None


@dataclass
class Attempt:
    prefill: Worker
    decode: Worker
    response: httpx.Response | None
    closed: bool = False


def error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def is_deterministic(body: dict) -> bool:
    return body.get("temperature", 1.0) == 0 or body.get("seed") is not None


class Proxy:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics: RouterMetrics, headers: dict[str, str],
                 max_retries: int = 2, read_timeout_s: float = 60.0):
        self.pool, self.client, self.metrics, self.headers = pool, client, metrics, headers
        self.max_retries, self.read_timeout_s = max_retries, read_timeout_s
        self.closing = False  # set as the router shuts down: relayed streams end after their next event

    async def forward(self, path: str, body: bytes, request: Request | None = None) -> Response:
        """Relay one request; a client (`request`; None: one that cannot leave) that leaves before its
        response starts is let go, its attempt closed, so the decode server sees the disconnect and
        frees the request's cache."""
        state = _Request(self, path, body)
        if request is None:
            return await self._relay(state, body)
        try:
            return await unless_disconnected(request, self._relay(state, body))
        except ClientGone:
            state.count("cancelled")
            return Response(status_code=CLIENT_CLOSED)

    async def _relay(self, state: _Request, body: bytes) -> Response:
        try:
            parsed = json.loads(body)
            stream, deterministic = bool(parsed.get("stream")), is_deterministic(parsed)
        except (ValueError, AttributeError):  # let a decode server word the 400
            stream, deterministic = False, True
        first = await state.open()
        if isinstance(first, Response):
            return first
        if first.response.status_code != 200:  # a client fault (4xx): as the decode server said it
            return await state.rejected(first)
        if not stream:
            return await state.collect(first)
        return StreamingResponse(state.events(first, deterministic), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Request:
    """One client request across its attempts."""

    def __init__(self, proxy: Proxy, path: str, body: bytes):
        self.proxy, self.path, self.body = proxy, path, body
        self.excluded: set[str] = set()
        self.attempts = 0
        self.last_error = "no worker available"
        self.start = time.perf_counter()
        self.counted = False

    def count(self, outcome: str) -> None:
        """The request's outcome in the router's metrics, once whatever path ends it."""
        if not self.counted:
            self.counted = True
            self.proxy.metrics.requests.labels(outcome).inc()

    async def rejected(self, attempt: Attempt) -> Response:
        """A decode server's 4xx (the client's fault), passed on as it is."""
        content = await attempt.response.aread()
        await self.close(attempt)
        self.count("rejected")
        return Response(content, attempt.response.status_code, media_type="application/json")

    async def open(self) -> Attempt | Response:
        """The next attempt whose decode server answered with a status below 500, else the error response."""
        pool, metrics = self.proxy.pool, self.proxy.metrics
        while self.attempts <= self.proxy.max_retries:
            p, d = pool.pick("prefill", self.excluded), pool.pick("decode", self.excluded)
            if p is None or d is None:
                break
            if self.attempts:
                metrics.retries.inc()
            self.attempts += 1
            p.in_flight += 1
            d.in_flight += 1
            attempt = Attempt(p, d, None)
            request = self.proxy.client.build_request("POST", d.url + self.path, content=self.body,
                                                      headers=self.proxy.headers | {PREFILL_HEADER: p.url,
                                                                                    "content-type": "application/json"},
                                                      timeout=REQUEST_TIMEOUT)
            try:
                attempt.response = await watched(d, self.proxy.client.send(request, stream=True))
                if attempt.response.status_code < 500:
                    return attempt
                message = _message(await attempt.response.aread())
            except (httpx.HTTPError, WorkerUnresponsive) as e:
                await self.close(attempt)
                self.blame(d, f"decode server {d.url}: {type(e).__name__}: {e}")
                continue
            except BaseException:  # cancelled (the client left): the pair is not busy with it any more
                await self.close(attempt)
                raise
            await self.close(attempt)
            self.blame(await self.culprit(p, d, message), message)
        self.count("failed")
        return JSONResponse(error_body(f"no prefill/decode pair completed the request after {self.attempts} "
                                       f"attempt(s); last error: {self.last_error}", "upstream_failed"), status_code=502)

    async def culprit(self, p: Worker, d: Worker, message: str) -> Worker:
        """Which of a pair failed a request its decode server answered with a 5xx: the prefill server
        for a failed hand-off, unless the decode server is the one that no longer matches (a fresh poll
        of both tells), else the decode server."""
        if "prefill hand-off" not in message:
            return d
        await self.proxy.pool.refresh(self.proxy.client, [p, d])
        return d if d.mismatch and not p.mismatch else p

    def blame(self, worker: Worker, message: str) -> None:
        self.proxy.pool.failed(worker)
        self.proxy.metrics.worker_failures.labels(worker.role).inc()
        self.excluded.add(worker.url)
        self.last_error = message

    async def close(self, attempt: Attempt) -> None:
        """Once per attempt: its workers' in-flight counts, then its response's connection."""
        if attempt.closed:
            return
        attempt.closed = True
        attempt.prefill.in_flight -= 1
        attempt.decode.in_flight -= 1
        if attempt.response is not None:
            await attempt.response.aclose()

    async def collect(self, attempt: Attempt) -> Response:
        while True:
            try:
                content = await watched(attempt.decode, attempt.response.aread())
                await self.close(attempt)
                self.count("ok")
                self.proxy.metrics.e2e.observe(time.perf_counter() - self.start)
                return Response(content, 200, media_type="application/json")
            except (httpx.HTTPError, WorkerUnresponsive) as e:
                await self.close(attempt)
                self.blame(attempt.decode, f"decode server {attempt.decode.url}: {type(e).__name__}: {e}")
            except BaseException:  # cancelled (the client left): closing the response tells the decode server
                await self.close(attempt)
                raise
            attempt = await self.open()
            if isinstance(attempt, Response):
                return attempt
            if attempt.response.status_code != 200:
                return await self.rejected(attempt)

    async def events(self, attempt: Attempt, deterministic: bool) -> AsyncIterator[str]:
        sent, first_id, first_time, outcome = 0, None, None, "broken"
        try:
            while True:
                try:
                    seen = 0
                    lines = attempt.response.aiter_lines()
                    while (line := await watched(attempt.decode, asyncio.wait_for(
                            _next_line(lines), self.proxy.read_timeout_s))) is not None:
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            outcome = "ok"
                            break
                        event = json.loads(data)
                        if "error" in event:
                            if event["error"].get("type") == "invalid_request_error":  # the client's fault
                                outcome = "rejected"
                                yield f"data: {data}\n\n"
                                break
                            raise StreamBroken(event["error"].get("message", "error event"))  # the server's
                        seen += 1
                        if seen <= sent:  # a retry replays what the client already has
                            continue
                        if first_id is None:
                            first_id, first_time = event.get("id"), time.perf_counter()
                            self.proxy.metrics.ttft.observe(first_time - self.start)
                        elif event.get("id") != first_id:
                            event["id"] = first_id
                            data = json.dumps(event)
                        sent += 1
                        yield f"data: {data}\n\n"
                        if self.proxy.closing:  # the router is shutting down: end the stream cleanly
                            outcome = "closed"
                            yield _error_event("the router is shutting down")
                            break
                    if outcome in ("closed", "rejected"):
                        break
                    if outcome != "ok":
                        raise StreamBroken("the stream ended without [DONE]")
                    break
                except (httpx.HTTPError, StreamBroken, ValueError, WorkerUnresponsive, asyncio.TimeoutError) as e:
                    await self.close(attempt)
                    self.blame(attempt.decode, f"decode server {attempt.decode.url} broke off the stream: {e}")
                    attempt = None
                    if not deterministic and sent:
                        yield _error_event("the decode server failed mid-stream and the output is not "
                                           f"deterministic (no seed, temperature > 0): {e}")
                        break
                    opened = await self.open()
                    if isinstance(opened, Response):
                        yield _error_event(json.loads(opened.body)["error"]["message"])
                        break
                    attempt = opened
                    if attempt.response.status_code != 200:
                        yield _error_event(_message(await attempt.response.aread()))
                        break
        except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
            outcome = "cancelled"
            raise
        finally:
            if attempt is not None:
                await self.close(attempt)
            end = time.perf_counter()
            self.count(outcome if outcome in ("ok", "rejected", "cancelled") else "failed")
            self.proxy.metrics.e2e.observe(end - self.start)
            if first_time is not None and sent > 1:
                self.proxy.metrics.tpot.observe((end - first_time) / (sent - 1))
        yield "data: [DONE]\n\n"


def _error_event(message: str) -> str:
    return f"data: {json.dumps(error_body(message, 'upstream_failed'))}\n\n"


def _message(content: bytes) -> str:
    try:
        return json.loads(content)["error"]["message"]
    except Exception:
        return content[:200].decode(errors="replace")
