"""The router refuses a pairing that cannot work at start-up, in one line, and picks workers by load."""

from __future__ import annotations

import socket

import httpx
import pytest

from deltamoe.cli import main
from deltamoe.errors import ConfigError
from deltamoe.serve.router.workers import WorkerPool

INFO = {"role": "prefill", "model": "m", "weights": "w1", "block_size": 16, "signature": "abc",
        "load": {"free_blocks": 10}}


def fake_infos(monkeypatch, infos: dict[str, dict]) -> None:
    def get(url, **_):
        base = url.removesuffix("/internal/kv_transfer/info")
        return httpx.Response(200, json=infos[base], request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)


def test_unreachable_worker_is_one_line_at_start_up(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    assert main(["router", "--prefill", f"http://127.0.0.1:{port}", "--decode", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: prefill: http://127.0.0.1:{port} does not answer")


@pytest.mark.parametrize("change,field,message", [
    ({"role": "decode"}, "prefill", "runs as 'decode', not 'prefill'"),
    ({"block_size": 8}, "block_size", "uses block size 8"),
    ({"signature": "xyz"}, "model", "run different models or cache layouts"),
    ({"model": "other"}, "model", "serves model 'other'"),
    ({"weights": "w2"}, "model", "load different weights"),
])
def test_mismatched_workers_are_refused(monkeypatch, change, field, message):
    fake_infos(monkeypatch, {"http://p": INFO, "http://p2": INFO | change, "http://d": INFO | {"role": "decode"}})
    pool = WorkerPool(["http://p", "http://p2"], ["http://d"])
    with pytest.raises(ConfigError, match=message) as error:
        pool.check({})
    assert error.value.field == field


def test_pick_prefers_the_least_loaded_available_worker(monkeypatch):
    fake_infos(monkeypatch, {"http://p": INFO, "http://d1": INFO | {"role": "decode"},
                             "http://d2": INFO | {"role": "decode", "load": {"free_blocks": 20}}})
    pool = WorkerPool(["http://p"], ["http://d1", "http://d2"])
    pool.check({})
    assert pool.pick("decode", set()).url == "http://d2"  # equal queues: more free blocks
    pool.workers[2].in_flight = 1
    assert pool.pick("decode", set()).url == "http://d1"
    pool.failed(pool.workers[1])
    assert pool.pick("decode", set()).url == "http://d2"  # d1 sits out after a failure
    assert pool.pick("decode", {"http://d2"}).url == "http://d1"  # ...unless it is the only one left
    assert pool.pick("decode", {"http://d1", "http://d2"}) is None


@pytest.mark.parametrize("args,message", [
    (["--role", "decode"], "kv_transfer: the decode role needs a transport"),
    (["--kv-transfer", "mooncake"], "kv_transfer: a colocated server hands nothing off"),
    (["--role", "both", "--kv-transfer", "mooncake"], "role: expected one of"),
    (["--role", "prefill", "--kv-transfer", "nixl"], "kv_transfer: expected one of ['mooncake']"),
    (["--role", "decode", "--kv-transfer", "mooncake", "--kv-transfer-staging", "lots"], "kv_transfer_staging: expected"),
    (["--role", "prefill", "--kv-transfer", "mooncake", "--kv-transfer-inline-write", "8XB"],
     "kv_transfer_inline_write: expected"),
])
def test_serve_role_options_are_checked_first(capsys, args, message):
    assert main(["serve", "tiny", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}")


def test_health_is_503_while_a_role_has_no_available_worker(monkeypatch):
    """A worker that stops answering, or answers that its engine stopped, sits out; the router's /health
    says so with a 503 (a load balancer stops sending it what would fail) and recovers with it."""
    import asyncio

    from fastapi.testclient import TestClient

    from deltamoe.serve.router.app import build_router_app

    infos = {"http://p": INFO, "http://d": INFO | {"role": "decode"}}
    fake_infos(monkeypatch, infos)
    pool = WorkerPool(["http://p"], ["http://d"], cooldown_s=60.0)
    pool.check({})
    health = TestClient(build_router_app(pool)).get  # no lifespan: this test refreshes by hand
    assert health("/health").status_code == 200

    def answer(request: httpx.Request) -> httpx.Response:
        base = str(request.url).removesuffix("/internal/kv_transfer/info")
        if base not in infos:
            return httpx.Response(502)
        return httpx.Response(200, json=infos[base])

    async def refresh():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await pool.refresh(client)

    infos["http://d"] = INFO | {"role": "decode", "healthy": False}  # e.g. one of its worker ranks died
    asyncio.run(refresh())
    r = health("/health")
    assert r.status_code == 503 and r.json()["status"] == "no available decode server"
    del infos["http://p"]  # gone
    asyncio.run(refresh())
    assert health("/health").json()["status"] == "no available prefill or decode server"
    for w in pool.workers:  # their cooldowns over, both answer again
        w.down_until = 0.0
    infos["http://p"], infos["http://d"] = INFO, INFO | {"role": "decode", "healthy": True}
    asyncio.run(refresh())
    assert health("/health").status_code == 200


def test_router_asks_its_clients_for_the_api_key(monkeypatch):
    """A keyed router is no open door to keyed workers: /v1 needs the key (401 in OpenAI's shape), /health not."""
    from fastapi.testclient import TestClient

    from deltamoe.serve.router.app import build_router_app

    fake_infos(monkeypatch, {"http://p": INFO, "http://d": INFO | {"role": "decode"}})
    pool = WorkerPool(["http://p"], ["http://d"])
    pool.check({})
    client = TestClient(build_router_app(pool, api_key="sekret"))  # no lifespan: nothing is forwarded
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions")]:
        r = getattr(client, method)(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert client.get("/v1/models").status_code == 401
    r = client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    assert client.get("/health").status_code == 200
    with pytest.raises(ConfigError, match="empty API key"):
        build_router_app(pool, api_key="")


def test_an_empty_api_key_is_refused_at_start_up(capsys):
    for argv in (["serve", "tiny", "--api-key", ""], ["router", "--prefill", "http://p", "--decode", "http://d",
                                                     "--api-key", " "]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: api_key: empty API key")


def test_a_worker_that_wants_another_api_key_is_one_line_naming_the_key(monkeypatch):
    def get(url, headers=None, **_):
        ok = headers == {"Authorization": "Bearer right"}
        return httpx.Response(200 if ok else 401, json=INFO if ok else {"error": {}},
                              request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    for headers, message in [({}, "none sent"), ({"Authorization": "Bearer wrong"}, "a different key")]:
        with pytest.raises(ConfigError, match=message) as error:
            WorkerPool(["http://p"], ["http://d"]).check(headers)
        assert error.value.field == "api_key" and "\n" not in error.value.one_line()


def test_a_router_shutting_down_ends_relayed_streams_with_an_error_event(monkeypatch):
    """The router's Ctrl-C: `closing` ends each relayed stream after its next event with an error event and
    [DONE] (the client never sees a stream cut mid-response), and the decode server's stream is closed."""
    import asyncio
    import json

    from deltamoe.serve.router.metrics import RouterMetrics
    from deltamoe.serve.router.proxy import Proxy

    fake_infos(monkeypatch, {"http://p": INFO, "http://d": INFO | {"role": "decode"}})
    pool = WorkerPool(["http://p"], ["http://d"])
    pool.check({})
    closed = []

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(1000):  # a long answer
                yield f'data: {{"id": "c1", "choices": [{{"index": 0, "text": "{i}"}}]}}\n\n'.encode()
                await asyncio.sleep(0)

        async def aclose(self):
            closed.append(True)

    def decode_server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Events(), headers={"content-type": "text/event-stream"})

    async def main() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(decode_server)) as client:
            proxy = Proxy(pool, client, RouterMetrics(), {})
            response = await proxy.forward("/v1/completions", b'{"stream": true, "temperature": 0}')
            got = []
            async for chunk in response.body_iterator:
                got.append(chunk)
                if len(got) == 3:
                    proxy.closing = True
            return got

    got = asyncio.run(main())
    assert got[-1] == "data: [DONE]\n\n" and len(got) == 5  # the 3 events sent, the error, [DONE]
    assert "the router is shutting down" in json.loads(got[-2][len("data: "):])["error"]["message"]
    assert closed and all(w.in_flight == 0 for w in pool.workers)
