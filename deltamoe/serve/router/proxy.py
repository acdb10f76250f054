"""Forwarding one OpenAI request through a prefill/decode pair, with retries on a dead worker.

The router sends the client's body unchanged to a decode server, naming the prefill server in
the `X-DeltaMoE-Prefill-Url` header; the decode server has that prefill server compute the
prompt and hand it over, then streams the answer, which the router passes on.

Faults: a worker that cannot be reached, answers 5xx, or breaks a stream off is blamed (a
decode server's "prefill hand-off ... failed" message blames the prefill server) and sits out
a while; the request is tried again on another pair, at most `max_retries` times. Before the
first byte reaches the client a retry is always safe. Mid-stream, a retry is only exact when
the output is deterministic (temperature 0 or a seed): the new stream's events already sent are
skipped and its ids rewritten to the first stream's. Otherwise the client gets an in-band error
event, never a cut-off stream that looks complete.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltamoe.serve.kv_transfer.roles import PREFILL_HEADER
from deltamoe.serve.router.metrics import RouterMetrics
from deltamoe.serve.router.workers import Worker, WorkerPool


class StreamBroken(Exception):
    pass


@dataclass
class Attempt:
    prefill: Worker
    decode: Worker
    response: httpx.Response


def error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def is_deterministic(body: dict) -> bool:
    return body.get("temperature", 1.0) == 0 or body.get("seed") is not None


class Proxy:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics: RouterMetrics, headers: dict[str, str],
                 max_retries: int = 2):
        self.pool, self.client, self.metrics, self.headers = pool, client, metrics, headers
        self.max_retries = max_retries
        self.closing = False  # set as the router shuts down: relayed streams end after their next event

    async def forward(self, path: str, body: bytes) -> Response:
        try:
            parsed = json.loads(body)
            stream, deterministic = bool(parsed.get("stream")), is_deterministic(parsed)
        except (ValueError, AttributeError):  # let a decode server word the 400
            stream, deterministic = False, True
        state = _Request(self, path, body)
        first = await state.open()
        if isinstance(first, Response):
            return first
        if first.response.status_code != 200:  # a client fault (4xx): as the decode server said it
            content = await first.response.aread()
            await state.close(first)
            return Response(content, first.response.status_code, media_type="application/json")
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
            request = self.proxy.client.build_request("POST", d.url + self.path, content=self.body,
                                                      headers=self.proxy.headers | {PREFILL_HEADER: p.url,
                                                                                    "content-type": "application/json"})
            try:
                response = await self.proxy.client.send(request, stream=True)
            except httpx.HTTPError as e:
                await self.close(Attempt(p, d, None))
                self.blame(d, f"decode server {d.url}: {type(e).__name__}: {e}")
                continue
            attempt = Attempt(p, d, response)
            if response.status_code < 500:
                return attempt
            message = _message(await response.aread())
            await self.close(attempt)
            self.blame(p if "prefill hand-off" in message else d, message)
        self.proxy.metrics.requests.labels("failed").inc()
        return JSONResponse(error_body(f"no prefill/decode pair completed the request after {self.attempts} "
                                       f"attempt(s); last error: {self.last_error}", "upstream_failed"), status_code=502)

    def blame(self, worker: Worker, message: str) -> None:
        self.proxy.pool.failed(worker)
        self.proxy.metrics.worker_failures.labels(worker.role).inc()
        self.excluded.add(worker.url)
        self.last_error = message

    async def close(self, attempt: Attempt) -> None:
        attempt.prefill.in_flight -= 1
        attempt.decode.in_flight -= 1
        if attempt.response is not None:
            await attempt.response.aclose()

    async def collect(self, attempt: Attempt) -> Response:
        while True:
            try:
                content = await attempt.response.aread()
                await self.close(attempt)
                self.proxy.metrics.requests.labels("ok").inc()
                self.proxy.metrics.e2e.observe(time.perf_counter() - self.start)
                return Response(content, 200, media_type="application/json")
            except httpx.HTTPError as e:
                await self.close(attempt)
                self.blame(attempt.decode, f"decode server {attempt.decode.url}: {type(e).__name__}: {e}")
            attempt = await self.open()
            if isinstance(attempt, Response):
                return attempt
            if attempt.response.status_code != 200:
                content = await attempt.response.aread()
                await self.close(attempt)
                return Response(content, attempt.response.status_code, media_type="application/json")

    async def events(self, attempt: Attempt, deterministic: bool) -> AsyncIterator[str]:
        sent, first_id, first_time, outcome = 0, None, None, "broken"
        try:
            while True:
                try:
                    seen = 0
                    async for line in attempt.response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            outcome = "ok"
                            break
                        event = json.loads(data)
                        if "error" in event:  # the decode server failed in-band
                            raise StreamBroken(event["error"].get("message", "error event"))
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
                    if outcome == "closed":
                        break
                    if outcome != "ok":
                        raise StreamBroken("the stream ended without [DONE]")
                    break
                except (httpx.HTTPError, StreamBroken, ValueError) as e:
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
        finally:
            if attempt is not None:
                await self.close(attempt)
            end = time.perf_counter()
            self.proxy.metrics.requests.labels(outcome if outcome == "ok" else "failed").inc()
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
