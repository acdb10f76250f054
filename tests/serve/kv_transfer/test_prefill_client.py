"""The decode side's HTTP call to a prefill server: one kept-alive connection for every hand-off
(a client per call paid an SSL context and a connect each time), the report passed back, and a
prefill server's error answered as TransferFailed with its message."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deltamoe.serve.kv_transfer.mooncake_transport import TransferFailed
from deltamoe.serve.kv_transfer.roles import HttpPrefillClient


class FakePrefill(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    connections: set[int] = set()

    def do_POST(self):
        FakePrefill.connections.add(id(self.connection))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["transfer_id"] == "refused":
            status, answer = 502, {"error": {"message": "the write failed", "code": "kv_transfer_failed"}}
        else:
            status, answer = 200, {"bytes": len(body["token_ids"]), "auth": self.headers.get("Authorization")}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def prefill_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrefill)
    FakePrefill.connections = set()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hand_offs_share_one_connection_and_errors_name_the_cause(prefill_url):
    client = HttpPrefillClient(api_key="k")
    try:
        for n in (3, 5, 7):
            report = client(prefill_url, {"transfer_id": f"r{n}", "token_ids": list(range(n))}, 5.0)
            assert report == {"bytes": n, "auth": "Bearer k"}
        assert len(FakePrefill.connections) == 1
        with pytest.raises(TransferFailed, match="HTTP 502: the write failed"):
            client(prefill_url, {"transfer_id": "refused", "token_ids": [1, 2]}, 5.0)
    finally:
        client.close()
    with pytest.raises(TransferFailed, match="ConnectError"):
        HttpPrefillClient()("http://127.0.0.1:9", {"transfer_id": "x", "token_ids": [1, 2]}, 2.0)
