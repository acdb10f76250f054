"""The weight-update routes over a real server: a trainer pushes new weights through HTTP + a gloo
transfer group; the server then answers like a server started on the trainer's weights. A bad tensor
is a 400 naming it, and the old weights keep serving."""

from __future__ import annotations

import httpx
import pytest
import torch

from deltamoe.errors import RequestError
from deltamoe.model.load import build_model
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.api.weight_routes import weight_update_routes
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.rl.http_sync import HTTPWeightSync
from deltamoe.train.rl.weight_push import policy_tensors

KEY = "sk-rl"


@pytest.fixture(scope="module")
def server(helpers):
    engine = AsyncLLMEngine(LLMEngine(build_model(helpers.k31_tiny(), seed=3).eval(),
                                      config=EngineConfig(cache_memory="16MiB", max_model_len=64)))
    app = build_app(engine, "m", api_key=KEY, routers=[weight_update_routes(engine)])
    with ServerThread(app) as thread:
        yield thread.url, engine


def _greedy(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0})
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_push_over_http_and_gloo_swaps_the_weights(server, helpers):
    url, engine = server
    assert httpx.post(f"{url}/start_weight_update").status_code == 401  # behind the API key
    trainer = build_model(helpers.k31_tiny(), seed=11)
    prompt = [256, 5, 9, 11, 40, 2]
    before = _greedy(url, prompt)
    sync = HTTPWeightSync(url, KEY, bucket_bytes=64 * 1024)  # several buckets
    try:
        bad = {**policy_tensors(trainer), "lm_head.weight": torch.zeros(3, 3)}
        with pytest.raises(RequestError) as e:
            sync.push(bad)
        assert e.value.field == "lm_head.weight"
        assert _greedy(url, prompt) == before  # rejected: the old weights serve
        stats = sync.push(policy_tensors(trainer))
    finally:
        sync.close()
    assert stats["version"] == 1 and stats["tensors"] == len(trainer.state_dict())
    served = engine.engine.runner.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in trainer.state_dict().items())
    fresh = LLMEngine(trainer.eval(), config=EngineConfig(cache_memory="16MiB", max_model_len=64))
    want = fresh.generate([prompt], SamplingParams(max_tokens=5, temperature=0), progress=False)[0]
    got = _greedy(url, prompt)
    assert got == [fresh.tokenizer.decode([t]) for t in want.token_ids] and got != before
    assert httpx.get(f"{url}/weight_version", headers={"Authorization": f"Bearer {KEY}"}).json() == \
        {"version": 1, "updating": False}


@pytest.mark.parametrize("body, field", [
    ({"host": "127.0.0.1", "port": 1, "rank": 2, "world_size": 2}, "rank"),  # the trainer is 0: ranks 1..1
    ({"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "timeout_s": 1e308}, "timeout_s"),
    ({"host": "127.0.0.1", "port": "CLOSED", "rank": 1, "world_size": 2, "timeout_s": 2}, "host"),  # nobody there
])
def test_init_transfer_mistakes_are_400s_naming_the_field(server, body, field):
    import socket

    url, _ = server
    if body["port"] == "CLOSED":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            body = body | {"port": probe.getsockname()[1]}
    r = httpx.post(f"{url}/init_weight_transfer_engine", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_transfer_that_fails_at_the_agreement_leaves_no_update_open(server):
    """A trainer that never joins the agreement (the collective raises): the update is aborted, so the
    next one can start (it stayed open, and every start was refused until an abort by hand)."""
    from deltamoe.serve.engine.weight_transfer import TensorSpec
    from deltamoe.serve.engine.weight_update import WeightUpdater

    _, engine = server

    class SilentTrainer:  # the transfer group's agreement, timing out
        def agree(self, ok: bool) -> bool:
            raise RuntimeError("gloo timeout: the trainer never joined")

    updater = WeightUpdater(engine.engine)
    updater.group = SilentTrainer()
    updater.start_weight_update()
    weight = engine.engine.runner.model.lm_head.weight
    with pytest.raises(RuntimeError, match="never joined"):
        updater.update_weights([TensorSpec("lm_head.weight", "float32", tuple(weight.shape))])
    updater.start_weight_update()  # not "already open"
    updater.abort_weight_update()
