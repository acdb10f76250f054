"""The HTTP server against clients that leave, stall, flood or send huge fields; and its
published OpenAPI document, which a fuzz run drives (no 5xx, a healthy server after)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.connections import AcceptErrorLog, HTTPLimits
from deltamoe.serve.api.errors import MAX_MESSAGE_CHARS
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from tests.serve.conftest import k31_tiny

M, KEY = "tiny", "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
LIMITS = HTTPLimits(header_timeout_s=0.5, body_timeout_s=1.0, max_connections=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(build_model(k31_tiny(), seed=2), folder)
    engine = AsyncLLMEngine.from_pretrained(folder, EngineConfig(cache_memory="16MiB", max_model_len=64))
    app = build_app(engine, M, api_key=KEY, body_timeout_s=LIMITS.body_timeout_s)
    with ServerThread(app, limits=LIMITS) as thread:
        yield thread.url, thread.port


def http_count(url: str, endpoint: str, status: int) -> float:
    m = re.search(rf'^deltamoe_http_requests_total{{endpoint="{re.escape(endpoint)}",status="{status}"}} (\S+)$',
                  httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def healthy(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}{CMPL}", headers=AUTH, json={"model": M, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_client_leaving_mid_body_is_a_client_abort_not_a_500(server, caplog):
    url, port = server
    before_499, before_500 = http_count(url, CMPL, 499), http_count(url, CMPL, 500)
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"model\": ".encode())
            time.sleep(0.1)
        assert wait_for(lambda: http_count(url, CMPL, 499) == before_499 + 1)
    assert http_count(url, CMPL, 500) == before_500
    assert not [r for r in caplog.records if r.exc_info], "a client leaving must not log a traceback"
    healthy(url)


def test_body_that_stalls_is_a_408(server):
    url, port = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Length: 1000\r\n\r\n{".encode())
        s.settimeout(5)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_connection_without_complete_headers_is_closed(server, sent):
    url, port = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(sent)
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
    healthy(url)


def test_keep_alive_connection_dribbling_its_next_headers_is_closed(server):
    url, port = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        for _ in range(40):  # one header byte every 0.1 s: each arrival would reset a plain idle timer
            try:
                s.sendall(b"G")
            except OSError:
                break
            time.sleep(0.1)
        assert time.monotonic() - t0 < 3


def test_connections_beyond_the_limit_get_503(server):
    url, port = server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS.max_connections)]
    try:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)


def test_out_of_file_descriptors_is_logged_once(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = AcceptErrorLog(loop).install()
        with caplog.at_level(logging.WARNING, logger="deltamoe.serve.api"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
        assert len(caplog.records) == 1 and not caplog.records[0].exc_info
        assert "Too many open files" in caplog.records[0].getMessage()
        assert handler.count == 999  # counted for the next notice
        seen = []
        handler.previous = lambda _loop, context: seen.append(context["message"])
        loop.call_exception_handler({"message": "something else"})
        assert seen == ["something else"]
    finally:
        loop.close()


def test_error_bodies_do_not_echo_huge_input(server):
    url, _ = server
    stops = ["x" * 2**16] * 17  # one over the limit of 16 stop strings
    r = httpx.post(f"{url}{CMPL}", headers=AUTH, json={"model": M, "prompt": "a", "stop": stops}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert len(r.content) < 2 * MAX_MESSAGE_CHARS and "more characters" in r.json()["error"]["message"]
    r = httpx.post(f"{url}{CMPL}", headers=AUTH, json={"model": M, "prompt": "a", "logit_bias": {"k" * 10**5: "x"}})
    assert r.status_code == 400 and len(r.content) < 2 * MAX_MESSAGE_CHARS


def test_prompt_logprobs_on_chat_are_served_not_ignored(server):
    """vLLM's chat `prompt_logprobs` (it was a 400): the templated prompt's logprobs, top-level."""
    url, _ = server
    r = httpx.post(f"{url}{CHAT}", headers=AUTH, json={"model": M, "messages": [{"role": "user", "content": "ab"}],
                                                       "prompt_logprobs": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in body["prompt_logprobs"][1:])


@pytest.mark.parametrize("temperature", [4.853484876905667e-265, 5e-324, 1e-6])
def test_vanishing_temperature_is_greedy_not_a_500(server, temperature):
    """Found by the fuzz run: logits / 1e-265 overflow to inf and the sampler's probabilities to NaN."""
    url, _ = server
    body = {"model": M, "prompt": "0", "max_tokens": 3}
    greedy = httpx.post(f"{url}{CMPL}", headers=AUTH, json={**body, "temperature": 0}, timeout=30)
    r = httpx.post(f"{url}{CMPL}", headers=AUTH, json={**body, "temperature": temperature}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_openapi_publishes_the_request_models(server):
    url, _ = server
    doc = httpx.get(f"{url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in ((CMPL, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"model", "prompt", "stop", "max_tokens", "prompt_logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    # `model` may be left out (the served model answers, as vLLM); the prompt may not.
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert {"type": "string"} in schemas["CompletionRequest"]["properties"]["stop"]["anyOf"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def _fuzz(server, examples: int) -> None:
    """Bodies drawn by schemathesis from the served /openapi.json, valid (positive) and not (negative)."""
    import schemathesis

    url, _ = server
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json").json())
    cases = st.one_of([schema[path]["POST"].as_strategy(mode) for path in (CMPL, CHAT, "/tokenize", "/detokenize")
                       for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)])
    statuses: list[int] = []
    client = httpx.Client(base_url=url, headers=AUTH, timeout=60)

    # derandomize: the default suite draws the same bodies every run (a fuzz that passes by luck is no test)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(cases, st.booleans())
    def run(case, our_model):
        body = case.body
        if isinstance(body, dict):
            if our_model:  # otherwise nearly every body stops at "no such model"
                body["model"] = M
            if isinstance(body.get("max_tokens"), int):  # keep generations short
                body["max_tokens"] = min(max(body["max_tokens"], -2), 8)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()  # negative cases may be raw bytes
        r = client.post(case.path, content=content, headers={"Content-Type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code < 500, (body, r.text[:500])

    try:
        run()
    finally:
        client.close()
    assert any(s == 400 for s in statuses), statuses
    healthy(url)
    # and still serves: a valid request after the fuzz completes
    r = httpx.post(f"{url}{CMPL}", json={"model": M, "prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text[:500]


def test_fuzz_from_the_published_schema(server):
    _fuzz(server, examples=40)


@pytest.mark.slow
def test_fuzz_from_the_published_schema_long(server):
    _fuzz(server, examples=600)


def test_the_routers_connection_cap_counts_its_relay_sockets(monkeypatch):
    """Each router client holds a second socket (its decode server's): the cap on client connections
    is half the file budget, so the relays never run the process out of descriptors."""
    import resource

    from deltamoe.serve.api.connections import connection_limit

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1088, 4096))
    assert connection_limit(HTTPLimits()) == 1024
    assert connection_limit(HTTPLimits(sockets_per_connection=2)) == 512
    assert connection_limit(HTTPLimits(max_connections=8, sockets_per_connection=2)) == 8  # as asked
