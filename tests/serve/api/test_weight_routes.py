"""The weight-update routes over a real server: a trainer pushes new weights through HTTP + a gloo
transfer group; the server then answers like a server started on the trainer's weights. A bad tensor
is a 400 naming it, and the old weights keep serving."""

from __future__ import annotations

import time

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
    version = httpx.get(f"{url}/weight_version",
                                                       headers={"Authorization": f"Bearer {KEY}"}).json()["version"]
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
    assert stats["version"] == version + 1 and stats["tensors"] == len(trainer.state_dict())
    served = engine.engine.runner.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in trainer.state_dict().items())
    fresh = LLMEngine(trainer.eval(), config=EngineConfig(cache_memory="16MiB", max_model_len=64))
    want = fresh.generate([prompt], SamplingParams(max_tokens=5, temperature=0), progress=False)[0]
    got = _greedy(url, prompt)
    assert got == [fresh.tokenizer.decode([t]) for t in want.token_ids] and got != before
    assert httpx.get(f"{url}/weight_version", headers={"Authorization": f"Bearer {KEY}"}).json() == \
        {"version": version + 1, "updating": False}


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
        def agree(self, ok: bool, sizes: list[int]) -> tuple[bool, bool]:
            raise RuntimeError("gloo timeout: the trainer never joined")

    updater = WeightUpdater(engine.engine)
    updater.group = SilentTrainer()
    updater.start_weight_update()
    weight = engine.engine.runner.model.lm_head.weight
    with pytest.raises(RequestError, match="transfer group failed .*never joined.*init_weight_transfer_engine"):
        updater.update_weights([TensorSpec("lm_head.weight", "float32", tuple(weight.shape))])
    assert updater.group is None  # dropped: the next update says to init a new one, not a raw gloo error
    updater.start_weight_update()  # not "already open"
    updater.abort_weight_update()


def test_tensors_sent_in_another_dtype_than_announced_are_refused_not_fatal(server, helpers):
    """A trainer announcing float16 and sending float32 made gloo abort the whole server (a receive
    buffer of the wrong size is fatal in its C++): the plans are compared first, nobody sends."""
    import concurrent.futures

    from deltamoe.train.rl.weight_push import send_over_group

    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    before = _greedy(url, [256, 7, 8])
    tensors = policy_tensors(build_model(helpers.k31_tiny(), seed=12))
    name = "lm_head.weight"
    sync = HTTPWeightSync(url, KEY, timeout_s=30)
    try:
        sync.connect()
        httpx.post(f"{url}/start_weight_update", headers=auth)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            route = pool.submit(httpx.post, f"{url}/update_weights", headers=auth, timeout=60, json={
                "names": [name], "dtype_names": ["float16"], "shapes": [list(tensors[name].shape)]})
            with pytest.raises(RequestError, match="other bytes than the specs"):
                send_over_group(sync.group, {name: tensors[name]}, 512 * 2**20)
            answer = route.result()
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "dtype_names"
        assert httpx.get(f"{url}/weight_version", headers=auth).json()["updating"] is False
        assert _greedy(url, [256, 7, 8]) == before  # alive, on the old weights
        stats = sync.push(tensors)  # the same group still works
        assert stats["tensors"] == len(tensors)
    finally:
        sync.close()


def test_a_malformed_update_body_releases_the_waiting_trainer(server, helpers):
    """A 400 before the agreement (2 names, 1 dtype) left the trainer blocked for its whole timeout,
    the group dead and the update open: now the trainer hears "no" at once and the update closes."""
    import concurrent.futures
    import time

    from deltamoe.train.rl.weight_push import send_over_group

    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    tensors = policy_tensors(build_model(helpers.k31_tiny(), seed=13))
    names = ["lm_head.weight", "model.embed_tokens.weight"]
    sync = HTTPWeightSync(url, KEY, timeout_s=60)
    try:
        sync.connect()
        for body in ({"names": names, "dtype_names": ["float32"], "shapes": [list(tensors[n].shape) for n in names]},
                     {"names": names, "dtype_names": ["float32"] * 2, "shapes": ["x", [1]]}):
            httpx.post(f"{url}/start_weight_update", headers=auth)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                route = pool.submit(httpx.post, f"{url}/update_weights", headers=auth, timeout=60, json=body)
                start = time.monotonic()
                with pytest.raises(RequestError, match="rejected"):
                    send_over_group(sync.group, {n: tensors[n] for n in names}, 512 * 2**20)
                assert time.monotonic() - start < 20  # not the group's 60 s timeout
                assert route.result().status_code == 400
            assert httpx.get(f"{url}/weight_version", headers=auth).json()["updating"] is False
        assert sync.push(tensors)["tensors"] == len(tensors)  # the group survived both
    finally:
        sync.close()


@pytest.fixture
def busy_server(helpers):
    """A server whose one long request keeps the engine busy until it is aborted."""
    engine = AsyncLLMEngine(LLMEngine(build_model(helpers.k31_tiny(max_position_embeddings=4096), seed=3).eval(),
                                      config=EngineConfig(cache_memory="16MiB", max_model_len=4096)))
    app = build_app(engine, "m", api_key=KEY, routers=[weight_update_routes(engine)])
    with ServerThread(app) as thread:
        yield thread.url, engine


def _long_stream(url: str) -> tuple:
    """A streamed request of ~4,000 tokens in a thread; (thread, its finish reasons)."""
    import json
    import threading

    reasons: list = []

    def run():
        body = {"model": "m", "prompt": [256, 5, 9], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                    if reason:
                        reasons.append(reason)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, reasons


def _running(engine: AsyncLLMEngine, n: int = 1) -> None:
    import time

    deadline = time.monotonic() + 30
    while engine.engine.stats().num_running < n:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.02)


def _update_open_while_one_request_runs(busy_server) -> tuple:
    """The long request decoding and an update started: (url, engine, auth headers, the weight version
    before, the request's thread, its finish reasons)."""
    url, engine = busy_server
    auth = {"Authorization": f"Bearer {KEY}"}
    version = httpx.get(f"{url}/weight_version", headers=auth).json()["version"]
    thread, reasons = _long_stream(url)
    _running(engine)
    assert httpx.post(f"{url}/start_weight_update", headers=auth).status_code == 200
    return url, engine, auth, version, thread, reasons


def test_a_swap_waits_at_most_its_timeout_then_aborts_running_requests_when_asked(busy_server):
    """vLLM's pause with and without waiting: a swap that waited `timeout_s` for a running request is
    withdrawn (409; the update stays staged, and requests held for it go on at once); `running: abort`
    ends the running request ("abort") and swaps at once."""
    url, engine, auth, version, thread, reasons = _update_open_while_one_request_runs(busy_server)
    r = httpx.post(f"{url}/finish_weight_update", headers=auth, json={"timeout_s": 0.3}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running"
    assert httpx.get(f"{url}/weight_version", headers=auth).json() == {"version": version, "updating": True}
    short = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                       json={"model": "m", "prompt": [256, 7], "max_tokens": 2, "ignore_eos": True})
    assert short.status_code == 200  # not held behind the withdrawn swap
    r = httpx.post(f"{url}/finish_weight_update", headers=auth, json={"running": "abort"}, timeout=30)
    assert r.status_code == 200 and r.json()["version"] == version + 1
    thread.join(30)
    assert reasons == ["abort"]


def test_an_abort_withdraws_a_swap_that_waits_for_running_requests(busy_server):
    import concurrent.futures

    url, engine, auth, version, thread, reasons = _update_open_while_one_request_runs(busy_server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{url}/finish_weight_update", headers=auth, timeout=60)
        import time

        time.sleep(0.5)
        assert not waiting.done()
        aborted = httpx.post(f"{url}/abort_weight_update", headers=auth, timeout=10)
        assert aborted.status_code == 200
        r = waiting.result(10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "update_aborted"
    assert httpx.get(f"{url}/weight_version", headers=auth).json() == {"version": version, "updating": False}
    assert engine.engine.stats().num_running == 1  # the long request goes on, on the old weights
    httpx.post(f"{url}/start_weight_update", headers=auth)
    httpx.post(f"{url}/finish_weight_update", headers=auth, json={"running": "abort"}, timeout=30)
    thread.join(30)
    assert reasons == ["abort"]


def test_a_push_that_fails_on_the_trainer_side_leaves_no_update_open(server, helpers):
    """An int64 tensor fails the trainer's own packing after /start_weight_update: the push aborts the
    server's update, so the next push (and a new group) is not refused."""
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    trainer = build_model(helpers.k31_tiny(), seed=12)
    sync = HTTPWeightSync(url, KEY)
    try:
        bad = {**policy_tensors(trainer), "lm_head.weight": torch.zeros(3, 3, dtype=torch.int64)}
        with pytest.raises(Exception):
            sync.push(bad)
        assert httpx.get(f"{url}/weight_version", headers=auth).json()["updating"] is False
        assert sync.push(policy_tensors(trainer))["tensors"] == len(trainer.state_dict())
    finally:
        sync.close()


def test_a_new_transfer_group_is_refused_while_an_update_is_open(server):
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/start_weight_update", headers=auth).status_code == 200
    try:
        r = httpx.post(f"{url}/init_weight_transfer_engine", headers=auth,
                       json={"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "timeout_s": 2})
        assert r.status_code == 400 and "an update is open" in r.json()["error"]["message"]
    finally:
        httpx.post(f"{url}/abort_weight_update", headers=auth)


def test_an_update_left_open_by_a_gone_trainer_is_aborted_after_its_idle_timeout(server):
    """A trainer that died between start and finish leaves no update open for good: past its idle
    timeout the server aborts it (the staged tensors go), and another trainer can start."""
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    bad = httpx.post(f"{url}/start_weight_update", headers=auth, json={"idle_timeout_s": 0})
    assert bad.status_code == 400 and "idle_timeout_s" in bad.text
    assert httpx.post(f"{url}/start_weight_update", headers=auth, json={"idle_timeout_s": 2}).status_code == 200
    try:
        assert httpx.get(f"{url}/weight_version", headers=auth).json()["updating"]
        refused = httpx.post(f"{url}/start_weight_update", headers=auth)  # the first is still open
        assert refused.status_code == 400 and "already open" in refused.text
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/weight_version", headers=auth).json()["updating"]:
            assert time.monotonic() < deadline, "the idle update was never aborted"
            time.sleep(0.1)
        assert httpx.post(f"{url}/start_weight_update", headers=auth, json={"idle_timeout_s": None}).status_code == 200
        time.sleep(1.0)  # no timeout: it stays open
        assert httpx.get(f"{url}/weight_version", headers=auth).json()["updating"]
    finally:
        httpx.post(f"{url}/abort_weight_update", headers=auth)
