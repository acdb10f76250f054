"""P/D disaggregation with one-step-ahead scheduling, end to end: real `deltamoe serve --role ...
--async-scheduling` processes behind real routers. router -> prefill(async) -> decode(async),
router -> prefill(async) -> decode(one step at a time) and router -> prefill(one step at a time) ->
decode(async) answer concurrent greedy requests (prompts longer than a block, streaming and not)
with the colocated one-step engine's text, and every server's blocks and state slots are back in
their pools afterwards (read from /metrics). The same with worker ranks on both sides: prefill(--tp 2,
async) -> decode(--tp 2, async), and prefill(--ep 2, async) -> decode(--tp 2, async)."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from tests.serve.kv_transfer.test_handoff_workers import model  # noqa: E402,F401 (a fixture)
from tests.serve.router.test_disaggregated_workers import Pairs, assert_pair_equals_colocated, running  # noqa: E402

pytestmark = pytest.mark.slow
ASYNC = ["--async-scheduling"]


class AsyncPairs(Pairs):
    LAYOUT = {"prefill_async": ("prefill", ASYNC), "decode_async": ("decode", ASYNC),
              "prefill_sync": ("prefill", []), "decode_sync": ("decode", [])}
    ROUTED = {"both": ("prefill_async", "decode_async"), "prefill_only": ("prefill_async", "decode_sync"),
              "decode_only": ("prefill_sync", "decode_async")}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, model):  # noqa: F811
    with running(AsyncPairs, tmp_path_factory, model) as p:
        yield p


@pytest.mark.parametrize("router", list(AsyncPairs.ROUTED))
def test_greedy_through_router_with_async_scheduling_equals_colocated(pairs, model, helpers, router):  # noqa: F811
    assert_pair_equals_colocated(pairs, router, model, helpers.prompts(8, 6, 30, seed=23))


class AsyncWorkerPairs(Pairs):
    LAYOUT = {"prefill_tp": ("prefill", ["--tp", "2", *ASYNC]), "decode_tp": ("decode", ["--tp", "2", *ASYNC]),
              "prefill_ep": ("prefill", ["--ep", "2", *ASYNC])}
    ROUTED = {"tp_both": ("prefill_tp", "decode_tp"), "ep_to_tp": ("prefill_ep", "decode_tp")}


@pytest.fixture(scope="module")
def worker_pairs(tmp_path_factory, model):  # noqa: F811
    with running(AsyncWorkerPairs, tmp_path_factory, model) as p:
        yield p


@pytest.mark.parametrize("router", list(AsyncWorkerPairs.ROUTED))
def test_greedy_through_router_async_over_workers_equals_colocated(worker_pairs, model, helpers,  # noqa: F811
                                                                  router):
    assert_pair_equals_colocated(worker_pairs, router, model, helpers.prompts(8, 6, 30, seed=29))
