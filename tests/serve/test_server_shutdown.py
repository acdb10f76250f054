"""Ctrl-C on `deltamoe serve` with a stream open: the stream ends with an error event and [DONE] (not cut
mid-response), the log has no traceback, and the process exits within its grace period."""

from __future__ import annotations

import json
import signal
import threading

import httpx


def test_ctrl_c_ends_open_streams_with_an_error_event_and_done(serve_process):
    with serve_process(["tiny", "--no-compile", "--threads", "1", "--cache-memory", "16MiB",
                        "--log-level", "warning"]) as (proc, url):
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGINT)
        reader.join(30)
        assert not reader.is_alive()
        assert proc.wait(timeout=30) in (0, -signal.SIGINT, 130)
        err = proc.stderr.read().decode()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert "shutting down" in error["message"] and error["code"] == "model_unavailable"
    assert "Traceback" not in err and "timeout graceful shutdown exceeded" not in err, err[-2000:]
