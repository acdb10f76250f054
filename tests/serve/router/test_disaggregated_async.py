"""P/D disaggregation with one-step-ahead scheduling, end to end: real `deltamoe serve --role ...
--async-scheduling` processes behind real routers. router -> prefill(async) -> decode(async),
router -> prefill(async) -> decode(one step at a time) and router -> prefill(one step at a time) ->
decode(async) answer concurrent greedy requests (prompts longer than a block, streaming and not)
with the colocated one-step engine's text, and every server's blocks and state slots are back in
their pools afterwards (read from /metrics)."""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from deltamoe.model.weights import save_checkpoint  # noqa: E402
from tests.serve.kv_transfer.test_handoff_workers import model  # noqa: E402,F401 (a fixture)
from tests.serve.router.test_disaggregated_processes import assert_nothing_held, colocated, complete, metric  # noqa: E402
from tests.serve.router.test_disaggregated_workers import Pairs  # noqa: E402

pytestmark = pytest.mark.slow
ASYNC = ["--async-scheduling"]


class AsyncPairs(Pairs):
    LAYOUT = {"prefill_async": ("prefill", ASYNC), "decode_async": ("decode", ASYNC),
              "prefill_sync": ("prefill", []), "decode_sync": ("decode", [])}
    ROUTED = {"both": ("prefill_async", "decode_async"), "prefill_only": ("prefill_async", "decode_sync"),
              "decode_only": ("prefill_sync", "decode_async")}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, model):  # noqa: F811
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, ckpt)
    p = AsyncPairs(str(ckpt))
    yield p
    p.close()


@pytest.mark.parametrize("router", list(AsyncPairs.ROUTED))
def test_greedy_through_router_with_async_scheduling_equals_colocated(pairs, model, helpers, router):  # noqa: F811
    prompts = helpers.prompts(8, 6, 30, seed=23)
    expected = colocated(model, prompts, 12)
    url = pairs.urls[router]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ip: complete(url, ip[1], 12, stream=ip[0] % 2 == 0), enumerate(prompts)))
    assert got == expected
    prefill, decode = AsyncPairs.ROUTED[router]
    assert metric(pairs.urls[decode], "deltamoe_engine_kv_transfer_received") >= 8
    assert metric(pairs.urls[prefill], "deltamoe_engine_kv_transfer_sent") >= 8
    for name in (prefill, decode):
        assert_nothing_held(pairs.urls[name])
