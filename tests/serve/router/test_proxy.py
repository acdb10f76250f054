"""The router's retries against fake workers: a decode stream broken mid-way is resumed exactly for a
deterministic request (events the client has are skipped, ids kept) and ends in an in-band error
otherwise; a failed hand-off blames the prefill server and the retry uses another one."""

from __future__ import annotations

import asyncio
import json

import httpx

from deltamoe.serve.kv_transfer.roles import PREFILL_HEADER
from deltamoe.serve.router.metrics import RouterMetrics
from deltamoe.serve.router.proxy import Proxy
from deltamoe.serve.router.workers import WorkerPool


def sse(stream_id: str, texts: list[str], broken_after: int | None = None):
    async def body():
        for i, text in enumerate(texts):
            if broken_after is not None and i == broken_after:
                raise httpx.ReadError("connection reset")
            yield f"data: {json.dumps({'id': stream_id, 'choices': [{'index': 0, 'text': text}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return body()


def run(handler, body: dict) -> tuple[list[str], list[httpx.Request], Proxy]:
    seen: list[httpx.Request] = []

    async def record(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the router's poll of a worker (`culprit` asks the pair afresh)
            return httpx.Response(200, json={"load": {"free_blocks": 1}})
        seen.append(request)
        return await handler(request, len(seen))

    async def main():
        pool = WorkerPool(["http://p0", "http://p1"], ["http://d0", "http://d1"])
        async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
            proxy = Proxy(pool, client, RouterMetrics(), {}, max_retries=2)
            response = await proxy.forward("/v1/completions", json.dumps(body).encode())
            if not hasattr(response, "body_iterator"):
                return [response.body.decode()], proxy
            return [chunk async for chunk in response.body_iterator], proxy

    events, proxy = asyncio.run(main())
    return events, seen, proxy


TEXTS = ["a", "b", "c", "d", "e", "f"]


def texts(events: list[str]) -> list[str]:
    return [json.loads(e[6:])["choices"][0]["text"] for e in events if e.startswith("data: {") and "choices" in e]


def test_deterministic_stream_resumes_on_another_decode_server():
    async def handler(request, n):
        if n == 1:
            return httpx.Response(200, content=sse("cmpl-first", TEXTS, broken_after=3))
        return httpx.Response(200, content=sse("cmpl-second", TEXTS))

    events, seen, proxy = run(handler, {"prompt": "x", "stream": True, "temperature": 0})
    assert texts(events) == TEXTS and events[-1] == "data: [DONE]\n\n"
    assert {json.loads(e[6:])["id"] for e in events[:-1]} == {"cmpl-first"}
    assert [r.url.host for r in seen] == ["d0", "d1"]
    assert proxy.metrics.retries._value.get() == 1


def test_sampled_stream_broken_mid_way_ends_with_an_error_event():
    async def handler(request, n):
        return httpx.Response(200, content=sse("cmpl-x", TEXTS, broken_after=3))

    events, _, _ = run(handler, {"prompt": "x", "stream": True, "temperature": 0.8})
    assert texts(events) == TEXTS[:3]
    error = json.loads(events[-2][6:])
    assert "not deterministic" in error["error"]["message"] and events[-1] == "data: [DONE]\n\n"


def test_failed_hand_off_blames_the_prefill_server():
    async def handler(request, n):
        if n == 1:
            return httpx.Response(500, json={"error": {"message": "prefill hand-off from http://p0 failed: gone"}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    events, seen, _ = run(handler, {"prompt": "x"})
    assert json.loads(events[0]) == {"choices": [{"text": "ok"}]}
    assert [r.headers[PREFILL_HEADER] for r in seen] == ["http://p0", "http://p1"]
    assert [r.url.host for r in seen] == ["d0", "d0"]  # the decode server was not at fault


def test_client_errors_are_passed_through_without_retry():
    async def handler(request, n):
        return httpx.Response(400, json={"error": {"message": "max_tokens: bad"}})

    events, seen, _ = run(handler, {"prompt": "x", "stream": True})
    assert json.loads(events[0])["error"]["message"] == "max_tokens: bad" and len(seen) == 1


def test_every_pair_failing_is_a_502_naming_the_last_error():
    async def handler(request, n):
        raise httpx.ConnectError("refused")

    events, seen, _ = run(handler, {"prompt": "x"})
    body = json.loads(events[0])
    assert "after 2 attempt(s)" in body["error"]["message"] and "refused" in body["error"]["message"]
