"""The server under load and under clients that leave: nothing lost, memory freed, memory bounded."""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import openai
import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig

M = "tiny"
CLIENTS, TOKENS = 64, 12


@pytest.fixture(scope="module")
def server(tmp_path_factory, helpers):
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(build_model(helpers.k31_tiny(), seed=4), folder)
    config = EngineConfig(cache_memory="64MiB", max_num_seqs=CLIENTS, max_model_len=512)
    engine = AsyncLLMEngine.from_pretrained(folder, config)
    with ServerThread(build_app(engine, M)) as thread:
        yield thread.url, engine


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    """Until no request holds engine memory: nothing running or waiting, no blocks, no state slots."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == s.num_waiting == 0 and s.block_usage == 0 and s.slot_usage == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.stats()}")


def finished_count(url: str, reason: str) -> float:
    m = re.search(rf'^deltamoe_request_finished_total{{finish_reason="{reason}"}} (\S+)$',
                  httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


async def one_stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str, int]:
    """A streaming request (chat or completion, alternately): (id, usage tokens, finish reason, text chunks)."""
    common = dict(model=M, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}, seed=i,
                  extra_body={"ignore_eos": True})
    if i % 2:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": f"client {i}"}], **common)
    else:
        stream = await client.completions.create(prompt=f"client number {i}", **common)
    ids, reasons, usage, chunks = set(), [], None, 0
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            chunks += 1
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(ids) == 1 and len(reasons) == 1, (ids, reasons)
    return ids.pop(), usage.completion_tokens, reasons[0], chunks


async def one_round(url: str) -> list[tuple[str, int, str, int]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(one_stream(client, i) for i in range(CLIENTS)))
    finally:
        await client.close()


def test_64_concurrent_streams_all_finish_and_memory_stays_bounded(server):
    url, engine = server
    before = engine.stats()
    rss = []
    for _ in range(3):  # the first round warms allocators and caches; the later two must not grow
        results = asyncio.run(one_round(url))
        assert len({r[0] for r in results}) == CLIENTS  # every request answered, none mixed up
        assert all(tokens == TOKENS and reason == "length" and 1 <= chunks <= TOKENS + 1
                   for _, tokens, reason, chunks in results), results
        wait_idle(engine)
        rss.append(rss_bytes())
    after = engine.stats()
    assert after.requests_finished - before.requests_finished == 3 * CLIENTS
    assert after.generation_tokens_total - before.generation_tokens_total == 3 * CLIENTS * TOKENS
    assert rss[2] - rss[1] < 64 * 2**20, [r / 2**20 for r in rss]


def test_client_leaving_a_stream_aborts_and_frees_memory(server):
    url, engine = server
    aborted = finished_count(url, "abort")
    tokens_before = engine.stats().generation_tokens_total
    body = {"model": M, "prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        events = r.iter_lines()
        got = [line for line, _ in zip(events, range(6)) if line.startswith("data: ")]
        assert len(got) >= 2
        assert engine.stats().num_running == 1 and engine.stats().block_usage > 0
    # Closing the response drops the connection mid-stream; the engine must let go at once.
    wait_idle(engine, timeout=5)
    assert finished_count(url, "abort") == aborted + 1
    assert engine.stats().generation_tokens_total - tokens_before < 400


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    url, engine = server
    aborted = finished_count(url, "abort")
    tokens_before = engine.stats().generation_tokens_total
    body = {"model": M, "prompt": "wait for it", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(engine, timeout=5)
    assert finished_count(url, "abort") == aborted + 1
    assert engine.stats().generation_tokens_total - tokens_before < 450


def test_client_leaving_a_non_streaming_n2_request_is_counted_aborted(server):
    """With n > 1 the request was counted under choice 0's reason at that moment: "None" mid-way."""
    url, engine = server
    aborted, unknown = finished_count(url, "abort"), finished_count(url, "None")
    body = {"model": M, "prompt": "wait for both", "max_tokens": 200, "n": 2, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(engine, timeout=5)
    assert finished_count(url, "abort") == aborted + 1 and finished_count(url, "None") == unknown
