"""P/D hand-offs with worker ranks (gloo, spawned workers, the real Mooncake transfer engine):
prefill(ep2 or tp2) -> decode(1 process) and prefill(1 process) -> decode(ep2 or tp2) give the
colocated one-process engine's greedy tokens, token for token, for concurrent prompts longer than
a block (and a prefill-side prefix hit), packed and unpacked (straight into the pools: a staging area
of 0 bytes), with every block and slot back
afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.model.weights import save_checkpoint  # noqa: E402
from deltamoe.serve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402
from deltamoe.serve.kv_transfer.mooncake_connector import HandOffConfig, MooncakeConnector, RemotePrefill  # noqa: E402
from tests.serve.kv_transfer.test_handoff import (CONFIG, GREEDY, PrefillPool, assert_all_free, collect,  # noqa: E402
                                                  pool, run_then_close, settle)  # noqa: F401 (pool: a fixture)


@pytest.fixture(scope="module")
def model(helpers):
    """k31 tiny with its routed experts scaled up: at init their output is too small to move a greedy
    token, and with EP the worker rank's share of a batch reaches the logits only through them, so a
    worker running on a cache it lacks would go unnoticed."""
    model = build_model(helpers.k31_tiny(), seed=3).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or ".routed_expert_" in name:
                param.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("ckpt") / "k31-tiny"
    save_checkpoint(model, path)
    return str(path)


@pytest.fixture(scope="module")
def workload(model, helpers):
    """Concurrent prompts (5..30 tokens, blocks of 4), then two sharing 17 tokens (a prefill-side prefix hit)."""
    prompts = helpers.prompts(6, 5, 30, seed=7) + [list(range(17)) + [5, 6, 7], list(range(17)) + [9, 8, 7, 6, 5]]
    expected = [c.token_ids for c in LLMEngine(model, config=EngineConfig(**CONFIG)).generate(
        prompts, GREEDY, progress=False)]
    return prompts, expected


def engine_with_role(checkpoint: str, connector: MooncakeConnector, tp: int = 1, ep: int = 1) -> LLMEngine:
    return LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG), workers=WorkerConfig(tp=tp, ep=ep),
                                     connector=connector)


def hand_off(pool: PrefillPool, decode: AsyncLLMEngine, connector: MooncakeConnector, prompts) -> list[list[int]]:
    async def main():
        got = await asyncio.gather(*(collect(decode, p, "p0") for p in prompts[:6]))
        for p in prompts[6:]:
            got.append(await collect(decode, p, "p0"))
        await settle(decode.engine, pool.engines["p0"][0].engine)
        return got

    return run_then_close(decode, connector, main)


def check_moved(decode: LLMEngine, prefill: LLMEngine, prompts) -> None:
    for engine in (decode, prefill):
        assert_all_free(engine)
    received, sent = decode.stats().extra, prefill.stats().extra
    assert received["kv_transfer_received"] == sent["kv_transfer_sent"] == len(prompts)
    assert received["kv_transfer_failures"] == sent["kv_transfer_failures"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,staging_bytes", [(1, 2, 64 << 20), (1, 2, 0), (2, 1, 64 << 20), (2, 1, 0)],
                         ids=["ep2", "ep2-unpacked", "tp2", "tp2-unpacked"])
def test_prefill_with_workers_to_decode_one_process(checkpoint, workload, model, pool, tp, ep, staging_bytes):
    prompts, expected = workload
    prefill_connector = MooncakeConnector(HandOffConfig(staging_bytes=staging_bytes, direct_max_segments=-1))
    prefill = engine_with_role(checkpoint, prefill_connector, tp=tp, ep=ep)
    pool.engines["p0"] = (AsyncLLMEngine(prefill), prefill_connector)
    connector = MooncakeConnector(HandOffConfig(staging_bytes=staging_bytes), prefill_client=pool.client)
    decode = AsyncLLMEngine(LLMEngine(model, config=EngineConfig(**CONFIG), connector=connector))
    assert hand_off(pool, decode, connector, prompts) == expected
    check_moved(decode.engine, prefill, prompts)
    assert prefill.stats().prefix_hit_tokens >= 16


def decode_in_one_batch(decode: LLMEngine, connector: MooncakeConnector, prompts) -> list[list[int]]:
    """Admit every prompt (their loads start), wait for all the loads, then step: the first step runs every
    handed-off request at once, so the worker rank computes its share of them (with EP each rank routes
    its share of a batch's rows: a batch of one never reads the worker's cache)."""
    ids = []
    for p in prompts:
        seq = decode.make_sequence(p, GREEDY)
        seq.kv_transfer = RemotePrefill("p0")
        ids.append(decode.add_sequence(seq))
    decode.step()
    assert len(decode.scheduler.loading) == len(prompts)
    deadline = time.monotonic() + 60
    while connector.stats()["kv_transfer_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.delta_token_ids
        assert decode.last_batch_size in (0, len(prompts)) or not decode.scheduler.loading
    return [tokens[i] for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,staging_bytes", [(1, 2, 64 << 20), (2, 1, 64 << 20), (2, 1, 0)],
                         ids=["ep2", "tp2", "tp2-unpacked"])
def test_prefill_one_process_to_decode_with_workers(checkpoint, workload, model, pool, tp, ep, staging_bytes):
    prompts, expected = workload
    prefill = pool.add("p0", model, HandOffConfig(staging_bytes=staging_bytes, direct_max_segments=-1))
    connector = MooncakeConnector(HandOffConfig(staging_bytes=staging_bytes), prefill_client=pool.client)
    decode = engine_with_role(checkpoint, connector, tp=tp, ep=ep)
    processes = decode.executor.group.processes
    try:
        assert decode_in_one_batch(decode, connector, prompts) == expected
    finally:
        decode.shutdown()
        connector.close()
    check_moved(decode, prefill, prompts)
    assert all(p.poll() is not None for p in processes)  # the decode engine's workers stopped with it
