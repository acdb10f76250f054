"""P/D disaggregation end to end: real `deltamoe serve --role prefill|decode` processes and a real
`deltamoe router`, 2 prefill + 2 decode servers on one machine.

Greedy answers through router -> prefill -> decode equal the colocated engine's (completions and
chat, streaming and not, concurrent requests, prompts longer than a block and DSA's top-k); a
decode server killed mid-stream and a prefill server killed between requests cost a retry, not
an answer; afterwards every surviving server's blocks and state slots are back in their pools
(read from /metrics)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.model.weights import save_checkpoint  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
SERVE = ["--threads", "1", "--cache-memory", "8MiB", "--block-size", "4", "--max-num-batched-tokens", "32",
         "--log-level", "warning", "--kv-transfer", "mooncake", "--kv-transfer-timeout", "20"]
MODEL = "tiny-k31"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    return subprocess.Popen([sys.executable, "-m", "deltamoe", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def wait_up(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


class Cluster:
    def __init__(self, ckpt: str):
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        for name, role in [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")]:
            port = free_port()
            self.procs[name] = start(["serve", ckpt, "--served-model-name", MODEL, "--role", role, *SERVE], port)
            self.urls[name] = f"http://127.0.0.1:{port}"
        for name in list(self.procs):
            wait_up(self.procs[name], self.urls[name])
        port = free_port()
        self.procs["router"] = start(["router", "--prefill", self.urls["p0"], "--prefill", self.urls["p1"],
                                      "--decode", self.urls["d0"], "--decode", self.urls["d1"],
                                      "--log-level", "warning", "--read-timeout", "30"], port)
        self.url = f"http://127.0.0.1:{port}"
        wait_up(self.procs["router"], self.url, 60)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def model(helpers):
    return build_model(helpers.k31_tiny(), seed=1).eval()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model):
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, ckpt)
    c = Cluster(str(ckpt))
    yield c
    c.close()


def colocated(model, prompts: list[list[int]], max_tokens: int) -> list[str]:
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", block_size=4))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [c.text for c in engine.generate(prompts, params, progress=False)]


def complete(url: str, prompt, max_tokens: int, stream: bool, path: str = "/v1/completions") -> str:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    body |= {"prompt": prompt} if path.endswith("/completions") and "chat" not in path else {"messages": prompt}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text, done = "", False
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            delta = event["choices"][0]
            text += delta.get("text") or (delta.get("delta") or {}).get("content") or ""
    assert done
    return text


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


def assert_nothing_held(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        free = metric(url, "deltamoe_cache_free_blocks")
        info = httpx.get(url + "/internal/kv_transfer/info", timeout=5).json()["load"]
        if (free == info["num_blocks"] and info["kv_transfer_pinned"] == info["kv_transfer_loading"] == 0
                and metric(url, "deltamoe_state_slot_usage_ratio") == 0):
            return
        assert time.monotonic() < deadline, (url, free, info)
        time.sleep(0.2)


def test_greedy_through_router_equals_colocated(cluster, model, helpers):
    prompts = helpers.prompts(8, 2, 30, seed=21)
    expected = colocated(model, prompts, 12)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ip: complete(cluster.url, ip[1], 12, stream=ip[0] % 2 == 0), enumerate(prompts)))
    assert got == expected
    assert metric(cluster.url, "deltamoe_router_requests_total") >= 8
    for name in ("d0", "d1"):  # both decode servers got work (load-aware choice)
        assert metric(cluster.urls[name], "deltamoe_engine_kv_transfer_received_total") >= 1
    for name in ("p0", "p1"):
        assert metric(cluster.urls[name], "deltamoe_engine_kv_transfer_sent_total") >= 1
        assert metric(cluster.urls[name], "deltamoe_time_to_first_token_seconds_count") >= 1  # prompt computed
        assert metric(cluster.urls[name], "deltamoe_engine_kv_transfer_bytes_sent_total") > 0


def test_chat_streaming_and_not(cluster):
    messages = [{"role": "user", "content": "hello there, a prompt longer than one block"}]
    a = complete(cluster.url, messages, 10, stream=True, path="/v1/chat/completions")
    b = complete(cluster.url, messages, 10, stream=False, path="/v1/chat/completions")
    assert a == b and len(a) > 0


def test_decode_killed_mid_stream_is_retried(cluster, model, helpers):
    prompt = helpers.prompts(1, 20, 20, seed=5)[0]
    expected = colocated(model, [prompt], 150)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, done, killed = "", False, None
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if killed is None and len(text) >= 5:
                workers = httpx.get(cluster.url + "/health").json()["workers"]
                busy = [w["url"] for w in workers if w["role"] == "decode" and w["in_flight"]]
                killed = next(n for n, u in cluster.urls.items() if u == busy[0])
                cluster.kill(killed)
    assert done and text == expected
    assert metric(cluster.url, "deltamoe_router_retries_total") >= 1
    survivor = "d1" if killed == "d0" else "d0"
    assert complete(cluster.url, prompt, 150, stream=False) == expected  # served by the survivor
    assert_nothing_held(cluster.urls[survivor])
    for name in ("p0", "p1"):
        assert_nothing_held(cluster.urls[name])


def test_prefill_killed_mid_prefill_is_retried_on_the_other(cluster, model, helpers):
    prompt = helpers.prompts(1, 300, 300, seed=12)[0]
    expected = colocated(model, [prompt], 8)[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, cluster.url, prompt, 8, True)
        killed = None
        deadline = time.monotonic() + 60
        while killed is None and not answer.done() and time.monotonic() < deadline:
            for name in ("p0", "p1"):
                if httpx.get(cluster.urls[name] + "/internal/kv_transfer/info").json()["load"]["running"]:
                    cluster.kill(name)
                    killed = name
                    break
            time.sleep(0.02)
        assert answer.result(120) == expected
    assert killed is not None  # the kill landed while a prompt was being computed
    others = [helpers.prompts(1, 12, 25, seed=s)[0] for s in (9, 10)]
    assert [complete(cluster.url, p, 8, stream=False) for p in others] == colocated(model, others, 8)
    survivor = "p1" if killed == "p0" else "p0"
    for name in (survivor, *[n for n in ("d0", "d1") if cluster.procs[n].poll() is None]):
        assert_nothing_held(cluster.urls[name])
