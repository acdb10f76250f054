"""A chat request with an image through real processes: `deltamoe router` -> a `--role prefill` server,
which embeds the image from the pixels the decode server sent with the hand-off request -> a
`--role decode` server that streams the answer. It equals a colocated `deltamoe serve` process's
answer, streamed and not, and the prompt really was handed off (read from /metrics)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from tests.serve.router.test_disaggregated_processes import (  # noqa: E402
    SERVE, complete, free_port, metric, start, wait_up)

pytestmark = pytest.mark.slow
MODEL = "tiny-k31"  # the name the shared helpers send


def data_url(color: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 24), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def servers():
    procs, urls = {}, {}
    try:
        for name, role in [("colocated", None), ("prefill", "prefill"), ("decode", "decode")]:
            port = free_port()
            args = ["serve", "tiny-vision", "--served-model-name", MODEL, *SERVE]
            if role is None:  # no transfer engine on the colocated server
                args = args[:args.index("--kv-transfer")] + args[args.index("--kv-transfer-timeout") + 2:]
            procs[name] = start(args + (["--role", role] if role else []), port)
            urls[name] = f"http://127.0.0.1:{port}"
        for name in procs:
            wait_up(procs[name], urls[name])
        port = free_port()
        procs["router"] = start(["router", "--prefill", urls["prefill"], "--decode", urls["decode"],
                                 "--log-level", "warning", "--read-timeout", "30"], port)
        urls["router"] = f"http://127.0.0.1:{port}"
        wait_up(procs["router"], urls["router"], 60)
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except Exception:
                proc.kill()


def test_image_chat_through_prefill_and_decode_equals_colocated(servers):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url("red")}},
                                             {"type": "text", "text": "what colour is this picture?"}]}]
    want = complete(servers["colocated"], messages, 8, stream=False, path="/v1/chat/completions")
    assert complete(servers["router"], messages, 8, stream=False, path="/v1/chat/completions") == want
    assert complete(servers["router"], messages, 8, stream=True, path="/v1/chat/completions") == want
    assert metric(servers["decode"], "deltamoe_engine_kv_transfer_received_total") >= 2
    assert metric(servers["prefill"], "deltamoe_engine_kv_transfer_sent_total") >= 2
