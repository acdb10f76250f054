"""Prefill -> decode hand-off through the real Mooncake transfer engine (TCP), two engines in one
process: the decode engine's greedy tokens equal the colocated engine's, token for token, for
concurrent prompts longer than a block and than DSA's top-k; and every block and state slot goes
back to its pool on both sides, also after failed hand-offs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from deltamoe.errors import RequestError  # noqa: E402

from deltamoe.serve.engine.async_engine import AsyncLLMEngine, RequestFailedError  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.serve.kv_transfer.mooncake_connector import (  # noqa: E402
    HandOffConfig, MooncakeConnector, PrefillUnanswered, RemotePrefill)
from deltamoe.serve.kv_transfer.mooncake_transport import TransferFailed  # noqa: E402
from deltamoe.serve.kv_transfer.pools import pool_tensors  # noqa: E402
from deltamoe.serve.kv_transfer.prefill_service import prefill_and_push  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = dict(cache_memory="4MiB", block_size=4, max_num_seqs=8, max_num_batched_tokens=24)


class PrefillPool:
    """Prefill engines in this process, reached by name the way a decode server reaches URLs."""

    def __init__(self):
        self.engines: dict[str, tuple[AsyncLLMEngine, MooncakeConnector]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = concurrent.futures.ThreadPoolExecutor(1)
        self.thread.submit(self.loop.run_forever)

    def add(self, name: str, model, hand_off: HandOffConfig | None = None, **config) -> LLMEngine:
        connector = MooncakeConnector(hand_off)
        engine = LLMEngine(model, config=EngineConfig(**(CONFIG | config)), connector=connector)
        self.engines[name] = (AsyncLLMEngine(engine), connector)
        return engine

    def client(self, url: str, payload: dict, timeout_s: float) -> dict:
        if url not in self.engines:
            raise ConnectionError(f"no prefill server at {url}")
        engine, connector = self.engines[url]
        return asyncio.run_coroutine_threadsafe(prefill_and_push(engine, connector, payload), self.loop).result(timeout_s)

    def close(self):
        for engine, connector in self.engines.values():
            engine.shutdown()
            connector.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.shutdown()


@pytest.fixture
def pool():
    p = PrefillPool()
    yield p
    p.close()


def decode_engine(model, pool: PrefillPool, timeout_s: float = 30.0, min_prompt_tokens: int = 2,
                  staging_bytes: int = 64 << 20, client=None, markers: bool = HandOffConfig.markers,
                  weights: str = "", **config) -> tuple[AsyncLLMEngine, MooncakeConnector]:
    hand_off = HandOffConfig(timeout_s=timeout_s, min_prompt_tokens=min_prompt_tokens, staging_bytes=staging_bytes,
                             markers=markers, weights=weights)
    connector = MooncakeConnector(hand_off, prefill_client=client or pool.client)
    return AsyncLLMEngine(LLMEngine(model, config=EngineConfig(**(CONFIG | config)), connector=connector)), connector


def run_then_close(decode: AsyncLLMEngine, connector: MooncakeConnector, main):
    """asyncio.run(main()), then stop the decode engine and its connector whatever happened."""
    try:
        return asyncio.run(main())
    finally:
        decode.shutdown()
        connector.close()


async def collect(engine: AsyncLLMEngine, prompt, url: str, params=GREEDY) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, params, kv_transfer=RemotePrefill(url)):
        tokens += out.delta_token_ids
    return tokens


def assert_all_free(engine: LLMEngine):
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.slot_usage) == (stats.num_blocks, 0.0)
    assert stats.extra["kv_transfer_in_flight"] == stats.extra["kv_transfer_pinned"] == 0
    assert not engine.scheduler.loading and not engine.has_unfinished()


async def settle(*engines: LLMEngine, timeout_s: float = 10.0):
    """Wait until no transfer holds memory any more (pinned blocks go back on the next steps)."""
    for _ in range(int(timeout_s / 0.02)):
        if not any(e.has_unfinished() for e in engines):
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("num_prefill", [1, 2])
def test_handoff_equals_colocated(k31_model, helpers, pool, num_prefill):
    concurrent_prompts = helpers.prompts(6, 1, 30, seed=7)
    # Then one after the other, sharing 17 tokens: the second hits the prefill side's prefix cache.
    followers = [list(range(17)) + [5, 6, 7], list(range(17)) + [9, 8, 7, 6, 5]]
    prompts = concurrent_prompts + followers
    expected = [c.token_ids for c in LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate(
        prompts, GREEDY, progress=False)]
    # p0 writes each hand-off straight into the decode side's pools (a few runs of blocks: zero-copy):
    # alone, its engine thread writes it and its notice in one synchronous call as the prefill ends;
    # beside p1, its engine thread submits the batch and a hand-off thread waits for it and sends the
    # notice. p1 packs every hand-off and writes it a pool at a time as it gathers it, all of it on
    # its hand-off thread.
    prefills = [pool.add(f"p{i}", k31_model, HandOffConfig(write_chunk_bytes=1, direct_max_segments=-1) if i
                         else None if num_prefill == 1 else HandOffConfig(inline_write_bytes=0))
                for i in range(num_prefill)]
    if num_prefill == 2:
        p1 = pool.engines["p1"][1]
        p1._start_packed = lambda *args, wait: MooncakeConnector._start_packed(p1, *args, wait=True) if wait else None
    decode, connector = decode_engine(k31_model, pool, markers=True)  # `--kv-transfer-markers`

    async def main():
        got = await asyncio.gather(*(collect(decode, p, f"p{i % num_prefill}")
                                     for i, p in enumerate(concurrent_prompts)))
        for p in followers:
            got.append(await collect(decode, p, "p0"))
        await settle(decode.engine, *prefills)
        return got

    got = run_then_close(decode, connector, main)
    assert got == expected
    for engine in [decode.engine, *prefills]:
        assert_all_free(engine)
    moved = connector.stats()
    handed_off = sum(len(p) > 1 for p in prompts)
    assert moved["kv_transfer_received"] == handed_off and moved["kv_transfer_failures"] == 0
    assert prefills[0].stats().extra["kv_transfer_unpacked"] == prefills[0].stats().extra["kv_transfer_sent"]
    assert num_prefill == 1 or prefills[1].stats().extra["kv_transfer_unpacked"] == 0
    sent = sum(p.stats().extra["kv_transfer_sent"] for p in prefills)
    assert sent == handed_off
    # Exactly (N-1) tokens of latent + indexer rows and one KDA state per hand-off, nothing more.
    layout = decode.engine.cache.layout
    assert moved["kv_transfer_bytes_received"] == sum((len(p) - 1) * layout.bytes_per_token + layout.bytes_per_state_slot
                                                      for p in prompts if len(p) > 1)
    assert sum(p.stats().extra["kv_transfer_bytes_sent"] for p in prefills) == moved["kv_transfer_bytes_received"]
    assert prefills[0].stats().prefix_hit_tokens >= 16
    p0 = prefills[0].stats().extra
    inline = p0["kv_transfer_written_inline"]
    if num_prefill == 1:  # alone: the step's hand-offs in one synchronous call (their batch, then their
        # completion markers), unless a hand-off thread of another hand-off waited on the transport then
        assert 0 < inline <= p0["kv_transfer_sent"] and p0["kv_transfer_seconds_inline"] > 0.0
    else:  # beside p1: one batch started by the engine thread, then a hand-off thread writes the marker
        assert inline == 0
    assert p0["kv_transfer_writes"] == 2 * p0["kv_transfer_sent"]  # each: its batch, then its marker
    # The decode side learnt of the hand-offs from their markers (`markers.py`), not the engine's notice.
    assert 0 < moved["kv_transfer_landed_on_notice"] <= moved["kv_transfer_markers_seen"] <= handed_off
    # Segments: at least a run per paged layer and at most one per block, plus the state slot's two.
    n_paged = len(layout.latent_layers) + len(layout.index_layers)
    assert p0["kv_transfer_sent"] * (n_paged + 2) <= p0["kv_transfer_segments_direct"] <= sum(
        n_paged * -(-(len(p) - 1) // 4) + 2 for p in prompts if len(p) > 1)
    # ... a started write timed by phase: submission, the batch on the wire, the notice's write.
    phases = [p0[f"kv_transfer_seconds_{part}"] for part in ("submitting", "transferring", "notifying")]
    assert num_prefill == 1 or min(phases) > 0.0
    assert sum(phases) + p0["kv_transfer_seconds_inline"] == pytest.approx(p0["kv_transfer_seconds_writing"])
    if num_prefill == 2:  # p1: a write per pool, then the completion marker's
        p1 = prefills[1].stats().extra
        assert p1["kv_transfer_writes"] == p1["kv_transfer_sent"] * (1 + sum(
            1 for t in pool_tensors(prefills[1].cache).values() if t.numel()))
    # One host, one clock: the decode side timed every hand-off from the prefill's finish to its cache.
    assert moved["kv_transfer_timed"] == handed_off
    assert moved["kv_transfer_seconds_finish_to_cache"] > max(0.0, moved["kv_transfer_seconds_notice"])
    # Concurrent hand-offs overlap: the seconds with one on its way count each shared second once.
    assert 0.0 < moved["kv_transfer_seconds_busy"] <= moved["kv_transfer_seconds_finish_to_cache"] + 1e-9


def test_handoff_on_notices(k31_model, helpers, pool):
    """A decode side that arms no completion markers (the default) learns of each hand-off's end from
    the transfer engine's notice, sent with the data's write: same tokens."""
    prompts = helpers.prompts(3, 6, 30, seed=11)
    expected = [c.token_ids for c in LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate(
        prompts, GREEDY, progress=False)]
    prefill = pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool, markers=False)

    async def main():
        got = [await collect(decode, p, "p0") for p in prompts]  # one at a time: each written inline
        await settle(decode.engine, prefill)
        return got

    assert run_then_close(decode, connector, main) == expected
    assert_all_free(decode.engine)
    assert_all_free(prefill)
    moved, sent = connector.stats(), prefill.stats().extra
    assert moved["kv_transfer_received"] == sent["kv_transfer_sent"] == len(prompts)
    assert moved["kv_transfer_markers_seen"] == 0 and moved["kv_transfer_landed_on_notice"] > 0
    assert sent["kv_transfer_writes"] == sent["kv_transfer_sent"]  # the notice rides on the batch: one write each


def test_failed_handoff_is_an_error_and_frees_everything(k31_model, helpers, pool):
    pool.add("p0", k31_model)
    # The default 30 s bound: the refusal below is immediate whatever the bound, and a 5 s one failed
    # the healthy hand-off after it on a loaded CI host (prefill + first connection past 4 s).
    decode, connector = decode_engine(k31_model, pool)
    prompt = helpers.prompts(1, 20, 20, seed=1)[0]

    async def main():
        with pytest.raises(RequestFailedError, match="no prefill server at nowhere"):
            await collect(decode, prompt, "nowhere")
        ok = await collect(decode, prompt, "p0")  # the engine lives on
        await settle(decode.engine, pool.engines["p0"][0].engine)
        return ok

    ok = run_then_close(decode, connector, main)
    assert ok == LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate([prompt], GREEDY, progress=False)[0].token_ids
    assert connector.stats()["kv_transfer_failures"] == 1
    assert_all_free(decode.engine)
    assert_all_free(pool.engines["p0"][0].engine)


@pytest.mark.parametrize("staging_bytes", [64 << 20, 1024])
def test_the_notice_lands_a_handoff_before_the_prefill_server_answers(k31_model, helpers, pool, staging_bytes):
    """The decode side runs a handed-off request once the transfer engine's completion notice is in:
    here the prefill call's answer is held back until the decode side has streamed its whole answer,
    packed (scattered from the staging area) and unpacked (written straight into the pools) alike."""
    prefill = pool.add("p0", k31_model, HandOffConfig(direct_max_segments=-1))
    answered = threading.Event()

    def held_answer(url: str, payload: dict, timeout_s: float) -> dict:
        report = pool.client(url, payload, timeout_s)
        answered.wait(20.0)
        return report

    decode, connector = decode_engine(k31_model, pool, staging_bytes=staging_bytes, client=held_answer)
    prompt = helpers.prompts(1, 20, 20, seed=6)[0]

    async def main():
        got = await asyncio.wait_for(collect(decode, prompt, "p0"), 15.0)
        assert not answered.is_set()
        answered.set()
        await settle(decode.engine, prefill)
        return got

    got = run_then_close(decode, connector, main)
    assert got == LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate([prompt], GREEDY, progress=False)[0].token_ids
    assert connector.stats()["kv_transfer_landed_on_notice"] == 1
    assert prefill.stats().extra["kv_transfer_unpacked"] == (staging_bytes < 4096)
    assert_all_free(decode.engine)
    assert connector.staging.free_bytes() == connector.staging.nbytes


def test_the_answer_lands_a_handoff_whose_notice_was_not_seen(k31_model, helpers, pool):
    """When the prefill server's answer comes before the notice is polled (here: never), the hand-off's
    own thread lands it: same tokens, nothing left pinned."""
    prefill = pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool)
    connector.notices._poll = lambda: []
    prompt = helpers.prompts(1, 20, 20, seed=9)[0]

    async def main():
        got = await collect(decode, prompt, "p0")
        await settle(decode.engine, prefill)
        return got

    got = run_then_close(decode, connector, main)
    assert got == LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate([prompt], GREEDY, progress=False)[0].token_ids
    stats = connector.stats()
    assert stats["kv_transfer_received"] == 1 and stats["kv_transfer_landed_on_notice"] == 0
    assert_all_free(decode.engine)
    assert connector.staging.free_bytes() == connector.staging.nbytes


def test_a_failed_handoff_keeps_its_staging_range_while_a_write_may_land(k31_model, helpers, pool):
    """A prefill server that answered has ended every write: the range comes back at once. A call that
    ended without an answer may leave writes running: the range stays out of use for the transfer
    engine's bound on a write (shortened here), then comes back."""
    pool.add("p0", k31_model)
    failures = iter([TransferFailed("HTTP 502: the write failed"), PrefillUnanswered("ReadTimeout: no answer")])

    def failing(url: str, payload: dict, timeout_s: float) -> dict:
        raise next(failures)

    decode, connector = decode_engine(k31_model, pool, client=failing)
    connector.transport.write_bound_s = lambda nbytes: 0.5
    prompt = helpers.prompts(1, 20, 20, seed=8)[0]
    area = connector.staging

    async def main():
        with pytest.raises(RequestFailedError, match="the write failed"):
            await collect(decode, prompt, "p0")
        assert area.free_bytes() == area.nbytes
        with pytest.raises(RequestFailedError, match="no answer"):
            await collect(decode, prompt, "p0")
        failed_at = time.monotonic()
        assert area.free_bytes() < area.nbytes
        while area.free_bytes() < area.nbytes and time.monotonic() - failed_at < 10.0:
            await asyncio.sleep(0.02)
        assert area.free_bytes() == area.nbytes and time.monotonic() - failed_at > 0.3
        await settle(decode.engine)

    run_then_close(decode, connector, main)
    assert_all_free(decode.engine)


@pytest.mark.parametrize("prefill_config,decode_weights", [
    (dict(block_size=8), ""),
    (dict(hand_off=HandOffConfig(weights="aaaa")), "bbbb"),  # `serve` fingerprints the weights it loads
])
def test_mismatched_block_size_or_weights_are_refused_by_the_prefill_side(k31_model, helpers, pool, prefill_config,
                                                                         decode_weights):
    pool.add("p8", k31_model, **prefill_config)
    decode, connector = decode_engine(k31_model, pool, weights=decode_weights)

    async def main():
        with pytest.raises(RequestFailedError, match="different model, weights, cache layout, dtype or block size"):
            await collect(decode, helpers.prompts(1, 12, 12, seed=2)[0], "p8")
        await settle(decode.engine)

    run_then_close(decode, connector, main)
    assert_all_free(decode.engine)


def test_unreachable_decode_side_fails_the_push_in_bounded_time(k31_model, pool):
    """The prefill side writes to a transfer address nobody listens on: a TransferFailed, and its
    blocks and slot go back. The first write is the engine thread's own; after it failed, that peer's
    hand-offs go through a hand-off thread (a stalled peer holds the engine thread once at most)."""
    import time

    from deltamoe.serve.kv_transfer.mooncake_transport import TransferFailed

    prefill = pool.add("p0", k31_model)
    engine, connector = pool.engines["p0"]
    inline_calls = []
    write_unless_busy = connector.transport.write_unless_busy
    connector.transport.write_unless_busy = lambda *args, **kw: inline_calls.append(args[0]) or write_unless_busy(
        *args, **kw)
    dest = connector.descriptor.to_json() | {"session": "127.0.0.1:1"}
    for transfer_id in ("t1", "t2"):
        payload = {"transfer_id": transfer_id, "token_ids": list(range(10)), "first_block": 0,
                   "dst_blocks": [0, 1, 2], "dst_slot": 0, "dest": dest, "timeout_s": 5.0}
        start = time.monotonic()
        with pytest.raises(TransferFailed, match="127.0.0.1:1"):
            pool.client("p0", payload, 10.0)
        assert time.monotonic() - start < 5.0
    assert inline_calls == ["127.0.0.1:1"]

    async def wait():
        await settle(prefill)

    asyncio.run(wait())
    assert_all_free(prefill)
    assert connector.stats()["kv_transfer_failures"] == 2


def test_a_transfers_end_wakes_the_decode_engine(k31_model, helpers, pool, monkeypatch):
    """A decode step that only waits for a hand-off sleeps until the transfer ends, not for a poll period."""
    from deltamoe.serve.engine import async_engine

    monkeypatch.setattr(async_engine, "TRANSFER_POLL_S", 30.0)
    pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool)
    prompt = helpers.prompts(1, 20, 20, seed=5)[0]

    async def main():
        return await asyncio.wait_for(collect(decode, prompt, "p0"), 20.0)

    got = run_then_close(decode, connector, main)
    assert got == LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate([prompt], GREEDY, progress=False)[0].token_ids


def test_short_prompts_stay_on_the_decode_server(k31_model, helpers, pool):
    prefill = pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool, min_prompt_tokens=10)
    prompts = [helpers.prompts(1, 9, 9, seed=3)[0], helpers.prompts(1, 10, 10, seed=4)[0]]

    async def main():
        got = [await collect(decode, p, "p0") for p in prompts]
        await settle(decode.engine, prefill)
        return got

    got = run_then_close(decode, connector, main)
    assert got == [c.token_ids for c in LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate(
        prompts, GREEDY, progress=False)]
    assert connector.stats()["kv_transfer_received"] == 1  # only the 10-token prompt was handed off


def test_prompt_logprobs_are_computed_on_the_decode_server(k31_model, helpers, pool):
    """A hand-off carries no hidden states to score the prompt with: a request asking for prompt
    logprobs is prefilled on the decode server and answers as the colocated engine does."""
    prefill = pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool)
    prompts = helpers.prompts(2, 12, 20, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    async def main():
        got = []
        for p in prompts:
            outs = [out async for out in decode.generate(p, params, kv_transfer=RemotePrefill("p0"))]
            got.append((sum((o.delta_token_ids for o in outs), []), outs[0].prompt_logprobs))
        await settle(decode.engine, prefill)
        return got

    got = run_then_close(decode, connector, main)
    expected = LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate(prompts, params, progress=False)
    for (tokens, prompt_logprobs), want in zip(got, expected):
        assert tokens == want.token_ids
        assert len(prompt_logprobs) == len(want.prompt_logprobs) == len(want.prompt_token_ids) - 1
        for a, b in zip(prompt_logprobs, want.prompt_logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert connector.stats()["kv_transfer_received"] == 0


@pytest.mark.parametrize("kv_cache_dtype,staging_bytes,direct_max_segments,prefill_memory",
                         [("fp8", 64 << 20, -1, None), ("fp8", 64 << 20, 32, None), ("auto", 1024, -1, None),
                          ("auto", 64 << 20, 32, "256KiB"), ("fp8", 64 << 20, 32, "256KiB")])
def test_fp8_pages_and_unpacked_handoffs_equal_colocated(k31_model, helpers, pool, kv_cache_dtype, staging_bytes,
                                                         direct_max_segments, prefill_memory):
    """fp8 pages travel with their scales, packed or straight into the decode side's pools (zero-copy);
    a request larger than the decode side's staging area (1 KiB here) goes straight into its pools
    whatever the prefill side prefers, with the same result. A prefill server with less cache memory
    (fewer blocks: another layer stride in its pools) writes straight into the decode side's layers."""
    prompts = helpers.prompts(3, 12, 30, seed=11)
    expected = [c.token_ids for c in LLMEngine(k31_model, config=EngineConfig(**CONFIG, kv_cache_dtype=kv_cache_dtype))
                .generate(prompts, GREEDY, progress=False)]
    prefill = pool.add("p0", k31_model, HandOffConfig(direct_max_segments=direct_max_segments),
                       kv_cache_dtype=kv_cache_dtype, **({"cache_memory": prefill_memory} if prefill_memory else {}))
    decode, connector = decode_engine(k31_model, pool, staging_bytes=staging_bytes, kv_cache_dtype=kv_cache_dtype)
    if prefill_memory:
        assert prefill.cache.latent.shape[1] < decode.engine.cache.latent.shape[1]

    async def main():
        got = await asyncio.gather(*(collect(decode, p, "p0") for p in prompts))
        await settle(decode.engine, prefill)
        return got

    assert run_then_close(decode, connector, main) == expected
    assert_all_free(decode.engine)
    assert_all_free(prefill)
    layout = decode.engine.cache.layout
    assert connector.stats()["kv_transfer_bytes_received"] == sum(
        (len(p) - 1) * layout.bytes_per_token + layout.bytes_per_state_slot for p in prompts)
    direct = staging_bytes < 4096 or direct_max_segments >= 0
    assert prefill.stats().extra["kv_transfer_unpacked"] == (len(prompts) if direct else 0)


@pytest.mark.parametrize("async_side", ["prefill", "decode", "both"])
def test_async_scheduling_equals_colocated_sync(k31_model, helpers, pool, async_side):
    """One-step-ahead scheduling on the prefill side, the decode side or both (`executor/held_loads.py`):
    concurrent prompts longer than a block, four of them handed off while two others decode, give the
    colocated one-step engine's tokens, and every block and slot goes back on both sides."""
    prompts = helpers.prompts(6, 6, 30, seed=13)
    expected = [c.token_ids for c in LLMEngine(k31_model, config=EngineConfig(**CONFIG)).generate(
        prompts, GREEDY, progress=False)]
    prefill = pool.add("p0", k31_model, async_scheduling=async_side in ("prefill", "both"))
    decode, connector = decode_engine(k31_model, pool, async_scheduling=async_side in ("decode", "both"))

    async def main():
        first_token = asyncio.Event()

        async def lead(prompt):  # decodes while the followers are handed off
            tokens = []
            async for out in decode.generate(prompt, GREEDY, kv_transfer=RemotePrefill("p0")):
                tokens += out.delta_token_ids
                first_token.set()
            return tokens

        async def follower(prompt):
            await first_token.wait()
            return await collect(decode, prompt, "p0")

        got = await asyncio.gather(*map(lead, prompts[:2]), *map(follower, prompts[2:]))
        await settle(decode.engine, prefill)
        return got

    assert run_then_close(decode, connector, main) == expected
    assert (prefill.overlap is not None, decode.engine.overlap is not None) == (
        async_side in ("prefill", "both"), async_side in ("decode", "both"))
    for engine in (decode.engine, prefill):
        assert_all_free(engine)
    assert connector.stats()["kv_transfer_received"] == len(prompts)
    assert prefill.stats().extra["kv_transfer_sent"] == len(prompts)


def test_choices_fork_a_handed_off_prompt(k31_model, helpers, pool):
    """n > 1 on a decode server: choice 0's prompt is handed off, choices 1.. wait for it and fork its
    cache as it lands (no prompt computed on the decode server); the tokens equal the colocated
    engine's choices (seeded sampling, seed + i per choice, as the server asks)."""
    prefill = pool.add("p0", k31_model)
    decode, connector = decode_engine(k31_model, pool)
    prompt = helpers.prompts(1, 14, 14, seed=5)[0]
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(3)]

    async def choices(engine: AsyncLLMEngine, kv_transfer) -> list[list[int]]:
        streams = [engine.generate(prompt, p, request_id=f"c-{i}", fork_of="c-0" if i else None,
                                   kv_transfer=None if i else kv_transfer) for i, p in enumerate(params)]
        async def drain(stream):
            return sum([out.delta_token_ids async for out in stream], [])
        firsts = [asyncio.ensure_future(drain(streams[i])) for i in (1, 2, 0)]  # children first, as the server
        got = await asyncio.gather(*firsts)
        return [got[2], got[0], got[1]]

    forked = []
    fork = decode.engine.cache.fork
    decode.engine.cache.fork = lambda parent, child: forked.append(fork(parent, child)) or forked[-1]

    async def main():
        got = await choices(decode, RemotePrefill("p0"))
        await settle(decode.engine, prefill)
        return got

    got = run_then_close(decode, connector, main)
    colocated = AsyncLLMEngine(LLMEngine(k31_model, config=EngineConfig(**CONFIG)))
    try:
        want = asyncio.run(choices(colocated, None))
    finally:
        colocated.shutdown()
    assert got == want and len({tuple(t) for t in got}) > 1  # the choices differ, each as colocated
    assert connector.stats()["kv_transfer_received"] == 1  # one hand-off for the three choices
    assert forked == [True, True]  # the others forked its landed cache


def test_a_weight_update_on_one_side_refuses_hand_offs_until_both_took_it(k31_model, helpers, pool):
    """A live weight update (RL) on the decode server alone would continue the prefill server's cache of
    the old weights with the new ones: the update folds into the weights' fingerprint, so the prefill
    side refuses the hand-off (an error, not a mixed answer) until it took the same update; then the
    pair answers as a colocated engine on the new weights."""
    import copy

    from deltamoe.model.load import build_model
    from deltamoe.serve.engine.weight_update import WeightUpdater

    new = build_model(k31_model.config, seed=9).eval()
    tensors = dict(new.state_dict())
    prompt = helpers.prompts(1, 12, 12, seed=2)[0]
    expected = LLMEngine(new, config=EngineConfig(**CONFIG)).generate([prompt], GREEDY, progress=False)[0].token_ids
    prefill = pool.add("p0", copy.deepcopy(k31_model), HandOffConfig(weights="w0"))
    decode, connector = decode_engine(copy.deepcopy(k31_model), pool, weights="w0")

    def update(engine):
        updater = WeightUpdater(engine)
        updater.start_weight_update()
        updater.update_weights_from_tensors(tensors.items())
        return updater.finish_weight_update()

    async def main():
        await asyncio.wrap_future(decode.run_when_idle(lambda: update(decode.engine)))
        with pytest.raises(RequestFailedError, match="different model, weights"):
            await collect(decode, prompt, "p0")
        await settle(decode.engine)
        prefill_async = pool.engines["p0"][0]
        await asyncio.wrap_future(prefill_async.run_when_idle(lambda: update(prefill)))
        assert connector.descriptor.signature == pool.engines["p0"][1].descriptor.signature
        return await collect(decode, prompt, "p0")

    assert run_then_close(decode, connector, main) == expected
    assert connector.stats()["kv_transfer_received"] == 1


def test_image_prompts_hand_off_with_their_pixels(pool):
    """A chat prompt's images travel with the hand-off request (JSON: the prepared pixels' bytes): the
    prefill server embeds them as the decode server would, and the decode server's tokens equal the
    colocated engine's; a prompt ending in an image placeholder is computed on the decode server."""
    import json

    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model
    from deltamoe.serve.kv_transfer.image_payload import images_from_json, images_to_json
    from deltamoe.vision.preprocess import PreparedImage

    model = build_model(load_preset("tiny-vision"), seed=5).eval()
    placeholder = model.config.media_placeholder_token_id

    def image(seed: int) -> PreparedImage:
        g = torch.Generator().manual_seed(seed)
        return PreparedImage(torch.randn(3, 32, 48, generator=g), 6, content_hash=1000 + seed)

    def prompt(before: int, after: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, 256, (before,), generator=g).tolist() + [placeholder] * 6
                + torch.randint(0, 256, (after,), generator=g).tolist())

    requests = [(prompt(5, 7, 1), [image(1)]), (prompt(9, 3, 2), [image(2)]), (prompt(5, 7, 1), [image(3)]),
                (prompt(6, 0, 4), [image(4)])]  # the last ends in its image's placeholders
    colocated = LLMEngine(model, config=EngineConfig(**CONFIG))
    expected = [c.token_ids for c in colocated.generate([p for p, _ in requests], GREEDY, progress=False,
                                                        images=[i for _, i in requests])]
    assert expected[0] != expected[2]  # the image matters
    prefill = pool.add("p0", model)
    over_json = lambda url, payload, timeout_s: pool.client(url, json.loads(json.dumps(payload)), timeout_s)  # noqa: E731
    decode, connector = decode_engine(model, pool, client=over_json)

    async def main():
        got = []
        for p, imgs in requests:
            tokens = []
            async for out in decode.generate(p, GREEDY, kv_transfer=RemotePrefill("p0"), images=imgs):
                tokens += out.delta_token_ids
            got.append(tokens)
        await settle(decode.engine, prefill)
        return got

    assert run_then_close(decode, connector, main) == expected
    assert connector.stats()["kv_transfer_received"] == 3  # not the prompt ending in placeholders
    for engine in (decode.engine, prefill):
        assert_all_free(engine)
    # The payload's checks, each naming the field, before any pixels are decoded
    vision = model.config.vision
    good = images_to_json([image(1)])
    got = images_from_json(good, vision, 6)[0]
    assert torch.equal(got.pixels, image(1).pixels) and got.num_tokens == 6
    # the prefill side's cache key: from the bytes it received, equal for equal pixels, never the sender's
    assert got.content_hash == images_from_json(images_to_json([image(1)]), vision, 6)[0].content_hash
    assert got.content_hash != images_from_json(images_to_json([image(2)]), vision, 6)[0].content_hash
    nan = image(1)
    nan.pixels[0, 0, 0] = float("nan")
    cases = [({"num_tokens": 4}, "num_tokens 4 does not match"), ({"shape": [3, 32]}, r"expected \[3, H, W\]"),
             ({"shape": [3, 42, 28]}, "multiples of"), ({"data": good[0]["data"][:-8]}, "base64 characters"),
             ({"dtype": "int8"}, "malformed image"), ({"num_tokens": float("inf")}, "malformed image"),
             ({"shape": [3, 32.0, 48]}, "malformed image"), ({"data": "!" * len(good[0]["data"])}, "not base64"),
             (images_to_json([nan])[0], "NaN or inf")]
    for broken, message in cases:
        with pytest.raises(RequestError, match=message) as e:
            images_from_json([{**good[0], **broken}], vision, 6)
        assert e.value.field == "kv_transfer.images[0]"
    with pytest.raises(RequestError, match="more placeholder tokens than the prompt holds"):
        images_from_json(good * 2, vision, 11)
    with pytest.raises(RequestError, match="no vision tower"):
        images_from_json(good, None, 6)
