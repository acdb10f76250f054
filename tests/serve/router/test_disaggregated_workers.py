"""P/D disaggregation with worker ranks, end to end: real `deltamoe serve --role ... --ep 2 | --tp 2`
processes behind real routers. router -> prefill(--ep 2) -> decode(1 process), router -> prefill(1
process) -> decode(--ep 2) and router -> prefill(--tp 2) -> decode(--tp 2) answer concurrent greedy
requests (prompts longer than a block, streaming and not) with the colocated one-process engine's
text, and every server's blocks and state slots are back in their pools afterwards."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from deltamoe.model.weights import save_checkpoint  # noqa: E402
from tests.serve.kv_transfer.test_handoff_workers import model  # noqa: E402,F401 (a fixture)
from tests.serve.router.test_disaggregated_processes import (MODEL, SERVE, assert_nothing_held, colocated,  # noqa: E402
                                                             complete, free_port, metric, start, wait_up)

pytestmark = pytest.mark.slow


class Pairs:
    """Prefill/decode pairs, each behind a router of its own, with worker ranks on one side of each."""

    LAYOUT = {"prefill_ep": ("prefill", ["--ep", "2"]), "decode_1": ("decode", []),
              "prefill_1": ("prefill", []), "decode_ep": ("decode", ["--ep", "2"]),
              "prefill_tp": ("prefill", ["--tp", "2"]), "decode_tp": ("decode", ["--tp", "2"])}
    ROUTED = {"ep_prefill": ("prefill_ep", "decode_1"), "ep_decode": ("prefill_1", "decode_ep"),
              "tp_both": ("prefill_tp", "decode_tp")}

    def __init__(self, ckpt: str):
        self.procs, self.urls = {}, {}
        for name, (role, workers) in self.LAYOUT.items():
            port = free_port()
            self.procs[name] = start(["serve", ckpt, "--served-model-name", MODEL, "--role", role, *workers, *SERVE],
                                     port)
            self.urls[name] = f"http://127.0.0.1:{port}"
        for name in list(self.procs):
            wait_up(self.procs[name], self.urls[name], 300)
        for router, (prefill, decode) in self.ROUTED.items():
            port = free_port()
            self.procs[router] = start(["router", "--prefill", self.urls[prefill], "--decode", self.urls[decode],
                                        "--log-level", "warning", "--read-timeout", "60"], port)
            self.urls[router] = f"http://127.0.0.1:{port}"
            wait_up(self.procs[router], self.urls[router], 60)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except Exception:
                proc.kill()


@contextlib.contextmanager
def running(layout: type[Pairs], tmp_path_factory, model) -> Iterator[Pairs]:
    """`layout`'s servers and routers over `model` saved to a fresh folder, stopped on exit."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, ckpt)
    p = layout(str(ckpt))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, model):  # noqa: F811
    with running(Pairs, tmp_path_factory, model) as p:
        yield p


def assert_pair_equals_colocated(pairs: Pairs, router: str, model, prompts: list[list[int]]) -> None:
    """8 concurrent greedy requests (streaming and not) through `router`: the colocated engine's text,
    every one handed off, and nothing held by the pair afterwards."""
    expected = colocated(model, prompts, 12)
    url = pairs.urls[router]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ip: complete(url, ip[1], 12, stream=ip[0] % 2 == 0), enumerate(prompts)))
    assert got == expected
    prefill, decode = pairs.ROUTED[router]
    assert metric(pairs.urls[decode], "deltamoe_engine_kv_transfer_received_total") >= len(prompts)
    assert metric(pairs.urls[prefill], "deltamoe_engine_kv_transfer_sent_total") >= len(prompts)
    for name in (prefill, decode):
        assert_nothing_held(pairs.urls[name])


@pytest.mark.parametrize("router", ["ep_prefill", "ep_decode", "tp_both"])
def test_greedy_through_router_with_workers_equals_colocated(pairs, model, helpers, router):  # noqa: F811
    assert_pair_equals_colocated(pairs, router, model, helpers.prompts(8, 6, 30, seed=21))
