"""A decode role's hand-offs under one-step-ahead scheduling (`executor/held_loads.py`): a load starts
on the device thread only after the step launched before its reservation has run and after the
reservation's state-slot writes; a request aborted before its load started gives its memory back and
its load never starts; a load that cannot start fails its request. A fake connector stands in for the
transport (tests/serve/kv_transfer/test_handoff.py holds the real one to the colocated engine's tokens)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.held_loads import HeldLoads
from deltamoe.serve.kv_transfer.connector import FinishedTransfers, KVConnector

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
JUNK = 7.0  # what an earlier request left in every state slot


class FakeLoads(KVConnector):
    """Hands off every request whose `kv_transfer` is "remote": at start it records what the load would
    find, writes its state (ones) and reports the load done."""

    def __init__(self):
        self.engine: LLMEngine | None = None
        self.before: dict[str, object] = {}  # request id -> the step in flight when its memory was reserved
        self.started: dict[str, dict] = {}
        self.finished = FinishedTransfers()

    def get_num_new_matched_tokens(self, seq, num_computed: int) -> int:
        if seq.kv_transfer != "remote" or seq.request_id in self.before:
            return 0
        self.before[seq.request_id] = self.engine.overlap._in_flight
        return seq.num_prompt_tokens - 1 - num_computed

    def update_state_after_alloc(self, seq, num_external_tokens: int) -> None:
        cache, before = self.engine.cache, self.before[seq.request_id]
        self.started[seq.request_id] = {
            "thread": threading.current_thread().name,
            "step_before_done": before is None or before.result.done(),
            "slot_zeroed": bool((cache.recurrent[:, seq.slot] == 0).all() and (cache.conv[:, seq.slot] == 0).all())}
        cache.recurrent[:, seq.slot] = 1.0
        self.finished.received.add(seq.request_id)

    def request_finished(self, seq, reason: str) -> bool:
        return False

    def get_finished(self) -> FinishedTransfers:
        done, self.finished = self.finished, FinishedTransfers()
        return done


def engine_with(connector: FakeLoads, model) -> LLMEngine:
    engine = LLMEngine(model, config=EngineConfig(cache_memory="4MiB", block_size=4, async_scheduling=True),
                       connector=connector)
    connector.engine = engine
    engine.cache.recurrent.fill_(JUNK)
    engine.cache.conv.fill_(JUNK)
    return engine


def add(engine: LLMEngine, prompt: list[int], remote: bool) -> str:
    seq = engine.make_sequence(prompt, GREEDY)
    seq.kv_transfer = "remote" if remote else None
    return engine.add_sequence(seq)


def run_out(engine: LLMEngine) -> dict[str, int]:
    tokens: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.delta_token_ids)
    return tokens


def test_a_load_starts_after_the_step_before_it_and_its_slot_writes(k31_model, helpers):
    loads = FakeLoads()
    engine = engine_with(loads, k31_model)
    try:
        local, remote = helpers.prompts(2, 9, 9, seed=3)
        first = add(engine, local, remote=False)
        early = sum(len(out.delta_token_ids) for _ in range(2) for out in engine.step())
        second = add(engine, remote, remote=True)  # reserved while a decode step of `first` is in flight
        tokens = run_out(engine)
        assert (tokens[first] + early, tokens[second]) == (GREEDY.max_tokens, GREEDY.max_tokens)
        started = loads.started[second]
        assert started["thread"].startswith("deltamoe-device")
        assert loads.before[second] is not None and started["step_before_done"]
        assert started["slot_zeroed"]  # the reservation's zeroing ran before the load, not over it
        stats = engine.stats()
        assert (stats.num_free_blocks, stats.slot_usage) == (stats.num_blocks, 0.0)
    finally:
        engine.shutdown()


def test_an_abort_before_the_load_starts_frees_the_memory_and_never_starts_it(k31_model, helpers):
    loads = FakeLoads()
    engine = engine_with(loads, k31_model)
    try:
        add(engine, helpers.prompts(1, 9, 9, seed=4)[0], remote=False)
        engine.step()
        gate = threading.Event()
        engine.overlap._pool.submit(gate.wait)  # the device thread waits: the load cannot start yet
        remote = add(engine, helpers.prompts(1, 12, 12, seed=5)[0], remote=True)
        engine.step()  # reserves its memory and hands its load to the (blocked) device thread
        assert remote in engine.scheduler.loading
        assert engine.abort(remote).finish_reason == "abort"
        gate.set()
        run_out(engine)
        engine.overlap._pool.submit(lambda: None).result()  # the device thread passed the boundary
        assert remote not in loads.started
        stats = engine.stats()
        assert (stats.num_free_blocks, stats.slot_usage) == (stats.num_blocks, 0.0)
    finally:
        engine.shutdown()


def test_a_load_that_cannot_start_fails_its_request():
    class Refusing(KVConnector):
        def get_num_new_matched_tokens(self, seq, num_computed):
            return 0

        def update_state_after_alloc(self, seq, num_external_tokens):
            raise RuntimeError("transport closed")

        def request_finished(self, seq, reason):
            return True

        def get_finished(self):
            return FinishedTransfers(received={"other"})

    woken = []
    inner = Refusing()
    inner.on_transfer_end = lambda: woken.append(True)
    loads = HeldLoads(inner)
    seq = SimpleNamespace(request_id="r1")
    loads.update_state_after_alloc(seq, 5)
    loads.start(loads.take())
    done = loads.get_finished()
    assert done.received == {"other"} and done.failed == {"r1": "the hand-off could not start: transport closed"}
    assert woken == [True]
    assert loads.request_finished(seq, "error") is True  # started (and failed): the real connector decides
