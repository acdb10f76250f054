"""One-step-ahead scheduling with a prefill/decode role over worker ranks (gloo, spawned workers, the real
Mooncake transfer engine): the handed-off caches reach every rank at the step that first runs them, and
the prefill side's pushes read the state every rank left, so the decode side's greedy tokens equal the
colocated one-process, one-step engine's, token for token, for concurrent prompts longer than a block,
with every block and state slot back afterwards on both sides.

Decode over tp2 with async runs in the default suite: two requests decode while four others are handed
off, so loads land at step boundaries while steps are in flight; under TP every rank computes its heads
of every row, so a rank that lacks a handed-off cache (or kept a slot the reservation zeroed on rank 0
only) changes the tokens. Behind `-m slow`: decode over ep2 with every handed-off request in one batch
(under EP a rank's rows reach the logits only when the batch is split over the ranks), and the prefill
side over tp2 / ep2 with async."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("mooncake.engine")

from deltamoe.serve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402
from deltamoe.serve.kv_transfer.mooncake_connector import HandOffConfig, MooncakeConnector, RemotePrefill  # noqa: E402
from tests.serve.kv_transfer.test_handoff import (CONFIG, GREEDY, assert_all_free, collect, pool,  # noqa: E402,F401
                                                  run_then_close, settle)
from tests.serve.kv_transfer.test_handoff_workers import checkpoint, model, workload  # noqa: E402,F401

# A KDA snapshot after every block, so a prompt sharing 17 tokens with an earlier one hits 16 of them.
ASYNC = EngineConfig(**CONFIG, async_scheduling=True, snapshot_interval_blocks=1)


def async_role(checkpoint: str, connector: MooncakeConnector, tp: int = 1, ep: int = 1) -> LLMEngine:  # noqa: F811
    return LLMEngine.from_pretrained(checkpoint, ASYNC, workers=WorkerConfig(tp=tp, ep=ep), connector=connector)


def add(engine: LLMEngine, prompt: list[int], remote: bool) -> str:
    seq = engine.make_sequence(prompt, GREEDY)
    seq.kv_transfer = RemotePrefill("p0") if remote else None
    return engine.add_sequence(seq)


def step_to_end(engine: LLMEngine, tokens: dict[str, list[int]], until=None) -> None:
    """Step until nothing is left (or `until()`), waiting briefly while only loads are in flight."""
    deadline = time.monotonic() + 120
    while engine.has_unfinished() and not (until and until()) and time.monotonic() < deadline:
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
        if engine.last_batch_size == 0:
            time.sleep(0.005)


def check_moved(decode: LLMEngine, prefill: LLMEngine, count: int) -> None:
    for engine in (decode, prefill):
        assert_all_free(engine)
        assert engine.overlap is None or engine.overlap._in_flight is None
    received, sent = decode.stats().extra, prefill.stats().extra
    assert received["kv_transfer_received"] == sent["kv_transfer_sent"] == count
    assert received["kv_transfer_failures"] == sent["kv_transfer_failures"] == 0


def test_decode_over_tp2_with_async_scheduling_equals_colocated(checkpoint, workload, model, pool):  # noqa: F811
    """A local request leaves a prefix snapshot. Then a handed-off request and a local one sharing that
    prefix come in together: the copy of the snapshot into the local request's slot is logged with the
    load's reservation and goes out at its step boundary, which every rank must replay. Once the first
    streams, four more are handed off while steps run."""
    prompts, expected = workload
    prefill = pool.add("p0", model)
    connector = MooncakeConnector(HandOffConfig(), prefill_client=pool.client)
    decode = async_role(checkpoint, connector, tp=2)
    try:
        assert decode.overlap is not None and decode.executor.hand_off is not None
        ids = [add(decode, prompts[6], remote=False)]
        tokens: dict[str, list[int]] = {ids[0]: []}
        step_to_end(decode, tokens)
        ids += [add(decode, prompts[7], remote=False), add(decode, prompts[0], remote=True)]
        tokens.update({i: [] for i in ids[1:]})
        step_to_end(decode, tokens, until=lambda: len(tokens[ids[2]]) > 0)
        assert decode.has_unfinished() and decode.stats().prefix_hit_tokens >= 16
        ids += [add(decode, p, remote=True) for p in prompts[1:6]]
        tokens.update({i: [] for i in ids[3:]})
        step_to_end(decode, tokens)
        asyncio.run(settle(prefill))
    finally:
        decode.shutdown()
        connector.close()
    assert [tokens[i] for i in ids] == expected[6:8] + expected[:6]
    check_moved(decode, prefill, 6)
    assert all(p.poll() is not None for p in decode.executor.group.processes)


@pytest.mark.slow
def test_decode_over_ep2_with_async_scheduling_in_one_batch(checkpoint, workload, model, pool):  # noqa: F811
    """Every handed-off request lands, then all run in the same steps: the worker rank computes its share
    of them from the caches rank 0 sent it."""
    prompts, expected = workload
    prefill = pool.add("p0", model)
    connector = MooncakeConnector(HandOffConfig(), prefill_client=pool.client)
    decode = async_role(checkpoint, connector, ep=2)
    try:
        ids = []
        for p in prompts:
            seq = decode.make_sequence(p, GREEDY)
            seq.kv_transfer = RemotePrefill("p0")
            ids.append(decode.add_sequence(seq))
        decode.step()  # reserves their memory; the loads start at the device thread's next boundary
        decode.overlap._pool.submit(lambda: None).result()
        deadline = time.monotonic() + 60
        while connector.stats()["kv_transfer_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        sizes = []
        while decode.has_unfinished():
            for out in decode.step():
                tokens[out.request_id] += out.delta_token_ids
            sizes.append(decode.last_batch_size)
    finally:
        decode.shutdown()
        connector.close()
    assert [tokens[i] for i in ids] == expected
    assert len(prompts) in sizes  # the handed-off requests ran together
    asyncio.run(settle(prefill))
    check_moved(decode, prefill, len(prompts))


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_prefill_over_workers_with_async_scheduling_equals_colocated(checkpoint, workload, model, pool,  # noqa: F811
                                                                     tp, ep):
    prompts, expected = workload
    prefill_connector = MooncakeConnector(HandOffConfig())
    prefill = async_role(checkpoint, prefill_connector, tp=tp, ep=ep)
    pool.engines["p0"] = (AsyncLLMEngine(prefill), prefill_connector)  # the pool closes it
    connector = MooncakeConnector(HandOffConfig(), prefill_client=pool.client)
    decode = AsyncLLMEngine(LLMEngine(model, config=ASYNC, connector=connector))

    async def main():
        got = await asyncio.gather(*(collect(decode, p, "p0") for p in prompts[:6]))
        for p in prompts[6:]:  # the second shares 17 tokens with the first: a prefill-side prefix hit
            got.append(await collect(decode, p, "p0"))
        await settle(decode.engine, prefill)
        return got

    assert run_then_close(decode, connector, main) == expected
    check_moved(decode.engine, prefill, len(prompts))
    assert prefill.stats().prefix_hit_tokens >= 16
