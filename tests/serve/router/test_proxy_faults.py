"""The router's fault rules that depend on time, the worker polls and who is at fault:

- a non-streamed answer (or a stream's first bytes, after the prefill) may take longer than
  `read_timeout_s`: the wait is bounded by the worker answering its polls, not by a clock
  (a real loopback HTTP server, since httpx's timeouts live in its real transport);
- the polls carry the router's API key, and notice a worker restarted with other weights;
- a failed hand-off is charged to the decode server when the decode server is the one that changed;
- an in-band error that is the client's fault reaches it as written, without blame or retry;
- a request is counted once in the router's metrics whatever path ends it;
- a client that leaves a non-streamed request is let go and its decode server told (Starlette
  cancels nothing for a non-streamed handler: the router polls for the disconnect itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import Request  # at module level: the fake server's handler annotation is read from here

from deltamoe.errors import ConfigError
from deltamoe.serve.router.metrics import RouterMetrics
from deltamoe.serve.router.proxy import Proxy
from deltamoe.serve.router.workers import UNRESPONSIVE_POLLS, WorkerPool
from tests.serve.router.test_workers import INFO, fake_infos


class Client:
    """The router's view of its client (`Request.is_disconnected`): gone `leaves_after_s` after it
    is first asked, or never."""

    def __init__(self, leaves_after_s: float | None = None):
        self.leaves_after_s, self.first_asked = leaves_after_s, None

    async def is_disconnected(self) -> bool:
        self.first_asked = self.first_asked or time.monotonic()
        return self.leaves_after_s is not None and time.monotonic() - self.first_asked > self.leaves_after_s


@contextlib.contextmanager
def slow_decode_server(delay_s: float, disconnects: list[float] | None = None) -> Iterator[str]:
    """A real HTTP server on loopback whose answer comes `delay_s` after the request (a decode
    server's non-streamed answer comes only once the whole generation is done); when the router
    closes the connection first, the time it noticed is appended to `disconnects`, as a decode
    server notices it to abort the generation."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        end = time.monotonic() + delay_s
        while time.monotonic() < end:
            await asyncio.sleep(0.05)
            if disconnects is not None and await request.is_disconnected():
                disconnects.append(time.monotonic())
                break
        return {"choices": [{"text": "slow but fine"}]}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def checked_pool(monkeypatch, decode: list[str], headers: dict | None = None) -> WorkerPool:
    fake_infos(monkeypatch, {"http://p": INFO} | {d: INFO | {"role": "decode"} for d in decode})
    pool = WorkerPool(["http://p"], decode)
    pool.check(headers or {})
    return pool


def forward(pool: WorkerPool, body: dict, read_timeout_s: float = 60.0, during=None,
            transport: httpx.AsyncBaseTransport | None = None, caller: Client | None = None) -> tuple[object, Proxy, float]:
    async def main():
        async with httpx.AsyncClient(transport=transport) as client:
            proxy = Proxy(pool, client, RouterMetrics(), {}, max_retries=2, read_timeout_s=read_timeout_s)
            side = asyncio.create_task(during()) if during else None
            start = time.monotonic()
            response = await proxy.forward("/v1/completions", json.dumps(body).encode(), caller or Client())
            if hasattr(response, "body_iterator"):
                response = [chunk async for chunk in response.body_iterator]
            if side is not None:
                side.cancel()
            return response, proxy, time.monotonic() - start

    return asyncio.run(main())


def test_a_non_streamed_answer_longer_than_the_read_timeout_arrives(monkeypatch):
    with slow_decode_server(delay_s=1.0) as url:
        pool = checked_pool(monkeypatch, [url])
        response, proxy, _ = forward(pool, {"prompt": "x"}, read_timeout_s=0.2)
    assert response.status_code == 200 and json.loads(response.body)["choices"][0]["text"] == "slow but fine"
    assert pool.workers[1].failures == 0 and proxy.metrics.requests.labels("ok")._value.get() == 1


def test_a_request_gives_up_on_a_worker_that_stops_answering_its_polls(monkeypatch):
    with slow_decode_server(delay_s=60.0) as url:  # e.g. a decode server stopped with SIGSTOP
        pool = checked_pool(monkeypatch, [url])

        async def polls_fail():
            await asyncio.sleep(0.3)
            pool.workers[1].poll_failures = UNRESPONSIVE_POLLS

        response, proxy, took = forward(pool, {"prompt": "x"}, during=polls_fail)
    assert response.status_code == 502 and took < 5
    assert "failed the router's last 3 health polls" in json.loads(response.body)["error"]["message"]
    assert proxy.metrics.requests.labels("failed")._value.get() == 1


def test_polls_send_the_api_key_and_notice_a_changed_worker(monkeypatch):
    pool = checked_pool(monkeypatch, ["http://d0", "http://d1"], headers={"Authorization": "Bearer k"})
    infos = {"http://p": INFO, "http://d0": INFO | {"role": "decode"}, "http://d1": INFO | {"role": "decode"}}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401)
        return httpx.Response(200, json=infos[str(request.url).removesuffix("/internal/kv_transfer/info")])

    async def refresh():
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker)) as client:
            await pool.refresh(client)

    asyncio.run(refresh())
    assert all(w.available and w.poll_failures == 0 for w in pool.workers)
    infos["http://d0"] = infos["http://d0"] | {"weights": "w9", "signature": "other"}  # restarted, other weights
    asyncio.run(refresh())
    d0 = pool.workers[1]
    assert not d0.available and "weights, signature changed" in d0.mismatch
    assert pool.pick("decode", set()).url == "http://d1" and pool.pick("decode", {"http://d1"}) is None
    infos["http://d0"] = INFO | {"role": "decode"}  # back as it was
    asyncio.run(refresh())
    assert d0.available and not d0.mismatch


def test_a_hand_off_refused_for_the_decode_servers_change_blames_the_decode_server(monkeypatch):
    pool = checked_pool(monkeypatch, ["http://d0", "http://d1"])
    posts: list[httpx.Request] = []

    def worker(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}"
        if request.method == "GET":
            changed = {"signature": "other"} if base == "http://d0" else {}
            return httpx.Response(200, json=INFO | {"role": "prefill" if base == "http://p" else "decode"} | changed)
        posts.append(request)
        if base == "http://d0":
            return httpx.Response(500, json={"error": {"message": "prefill hand-off from http://p failed: HTTP 400: "
                                                                  "kv_transfer: the decode server runs a different model"}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    response, _, _ = forward(pool, {"prompt": "x"}, transport=httpx.MockTransport(worker))
    assert response.status_code == 200 and [r.url.host for r in posts] == ["d0", "d1"]
    p, d0, _ = pool.workers
    assert p.failures == 0 and p.available and d0.failures == 1 and d0.mismatch


def test_a_clients_in_band_error_is_passed_on_without_blame_or_retry(monkeypatch):
    pool = checked_pool(monkeypatch, ["http://d0", "http://d1"])
    posts: list[httpx.Request] = []
    error = {"error": {"message": "structured_outputs.regex: the grammar failed", "type": "invalid_request_error",
                       "param": None, "code": "invalid_value"}}

    def worker(request: httpx.Request) -> httpx.Response:
        posts.append(request)
        events = [{"id": "c", "choices": [{"index": 0, "text": "a"}]}, error]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    events, proxy, _ = forward(pool, {"prompt": "x", "stream": True, "temperature": 0},
                               transport=httpx.MockTransport(worker))
    assert json.loads(events[-2][len("data: "):]) == error and events[-1] == "data: [DONE]\n\n"
    assert len(posts) == 1 and all(w.failures == 0 and w.available for w in pool.workers)
    assert proxy.metrics.requests.labels("rejected")._value.get() == 1
    assert proxy.metrics.retries._value.get() == 0


def test_a_stream_whose_retry_finds_no_pair_is_counted_once(monkeypatch):
    pool = checked_pool(monkeypatch, ["http://d0", "http://d1"])

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d1":
            raise httpx.ConnectError("refused")

        async def broken():
            yield b'data: {"id": "c", "choices": [{"index": 0, "text": "a"}]}\n\n'
            raise httpx.ReadError("connection reset")
        return httpx.Response(200, content=broken(), headers={"content-type": "text/event-stream"})

    events, proxy, _ = forward(pool, {"prompt": "x", "stream": True, "temperature": 0},
                               transport=httpx.MockTransport(worker))
    assert "refused" in json.loads(events[-2][len("data: "):])["error"]["message"]
    assert proxy.metrics.requests.labels("failed")._value.get() == 1


def test_a_prefill_server_taking_shorter_prompts_than_a_decode_server_is_refused(monkeypatch):
    fake_infos(monkeypatch, {"http://p": INFO | {"max_model_len": 512},
                             "http://d": INFO | {"role": "decode", "max_model_len": 4096}})
    with pytest.raises(ConfigError, match="takes prompts up to 512 tokens, a decode server up to 4096") as e:
        WorkerPool(["http://p"], ["http://d"]).check({})
    assert e.value.field == "max_model_len"
    fake_infos(monkeypatch, {"http://p": INFO | {"max_model_len": 8192},
                             "http://d": INFO | {"role": "decode", "max_model_len": 4096}})
    pool = WorkerPool(["http://p"], ["http://d"])
    pool.check({})

    from fastapi.testclient import TestClient

    from deltamoe.serve.router.app import build_router_app
    router = TestClient(build_router_app(pool))
    card = router.get("/v1/models").json()["data"][0]
    assert router.get(f"/v1/models/{card['id']}").json() == card
    assert router.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    assert card["max_model_len"] == 4096  # what the decode servers take, as their own cards say


def test_the_router_reads_bodies_within_the_servers_limit(monkeypatch):
    """A body over the servers' 32 MiB is a 413 at the router, which never holds more than a worker would take."""
    from fastapi.testclient import TestClient

    from deltamoe.serve.api.body import MAX_BODY_BYTES
    from deltamoe.serve.router.app import build_router_app

    pool = checked_pool(monkeypatch, ["http://d"])
    client = TestClient(build_router_app(pool))  # no lifespan: nothing can be forwarded
    r = client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_client_leaving_while_its_prefill_runs_frees_the_pair(monkeypatch, caplog):
    """The wait for a decode server's first bytes is cancelled when the client leaves: the pair's
    in-flight counts go back (they stayed raised, skewing every later pick), and the abandoned wait's
    outcome is read, never logged as "Task exception was never retrieved"."""
    import gc

    with slow_decode_server(delay_s=30.0) as url:
        pool = checked_pool(monkeypatch, [url])

        async def main():
            async with httpx.AsyncClient() as client:
                proxy = Proxy(pool, client, RouterMetrics(), {})
                task = asyncio.create_task(proxy.forward("/v1/completions", b'{"prompt": "x"}', Client()))
                await asyncio.sleep(0.3)
                assert [w.in_flight for w in pool.workers] == [1, 1]
                task.cancel()  # what Starlette does when the client disconnects
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.1)
            gc.collect()

        asyncio.run(main())
    assert [w.in_flight for w in pool.workers] == [0, 0]
    assert "never retrieved" not in caplog.text


def test_a_client_leaving_a_non_streamed_request_is_let_go_and_the_decode_server_told(monkeypatch):
    """The router waited for the whole generation of a client long gone (Starlette does not cancel a
    non-streamed handler), and the decode server kept generating it: now the router notices within
    its poll, closes the decode server's connection (which aborts the request there), frees the
    pair and counts the request `cancelled`."""
    disconnects: list[float] = []
    with slow_decode_server(delay_s=30.0, disconnects=disconnects) as url:
        pool = checked_pool(monkeypatch, [url])
        response, proxy, took = forward(pool, {"prompt": "x"}, caller=Client(leaves_after_s=0.3))
        deadline = time.monotonic() + 10
        while not disconnects and time.monotonic() < deadline:
            time.sleep(0.05)
    assert response.status_code == 499 and took < 5
    assert disconnects, "the decode server never saw the router let go"
    assert [w.in_flight for w in pool.workers] == [0, 0] and all(w.failures == 0 for w in pool.workers)
    assert proxy.metrics.requests.labels("cancelled")._value.get() == 1
    assert proxy.metrics.requests.labels("failed")._value.get() == 0
