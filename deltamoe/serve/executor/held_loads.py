"""HeldLoads: a decode role's hand-offs under one-step-ahead scheduling start at a step boundary.

On one step at a time, the scheduler reserves a handed-off request's blocks and state slot and the
connector starts writing into them at once (`update_state_after_alloc`): no step runs meanwhile, the
slot's zeroing is already done, and no step will touch that memory until the load is reported done.
With `executor/overlap.py` neither holds when the scheduler reserves the memory:
- a step launched earlier may still be writing it (a request that stopped one step late had its
  blocks and slot freed while the step scheduled ahead of its stop still runs), and
- the reservation's own state-slot writes (zeroing the slot, copying a prefix snapshot in) are only
  logged, to be replayed on the device thread: replayed after the handed-off state landed, they
  would overwrite it.
So the scheduler talks to the connector through this class: `update_state_after_alloc` only notes
the load, and `OverlappedSteps` starts the noted loads on its device thread, after every step
launched before and after replaying the state-slot writes logged so far (`start`). The request sits
in the scheduler's `loading` set all along and joins a batch at the first schedule after its load is
reported done, like on one step at a time.

A request that finishes (an abort) before its load started gives its memory back at once: nothing
but a forward may write it yet, and forwards run in launch order. Start and finish exclude each
other (one lock), so a load never starts on memory already given back.
"""

from __future__ import annotations

import threading

from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.kv_transfer.connector import FinishedTransfers, KVConnector

NotedLoad = tuple[Sequence, int]  # (the request, prompt tokens another engine provides)


class HeldLoads(KVConnector):
    def __init__(self, connector: KVConnector):
        self.connector = connector  # the engine's real connector (bound, counted in /metrics)
        self._lock = threading.Lock()
        self._held: dict[int, NotedLoad] = {}  # noted, not started; by id(sequence)
        self._new: list[NotedLoad] = []  # noted since the last `take`
        self._failed: dict[str, str] = {}  # loads that could not start, by request id

    # ------------------------------------------------------------------ the scheduler's side
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed: int) -> int:
        return self.connector.get_num_new_matched_tokens(seq, num_computed)

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        with self._lock:
            load = (seq, num_external_tokens)
            self._held[id(seq)] = load
            self._new.append(load)

    def request_finished(self, seq: Sequence, reason: str) -> bool:
        with self._lock:
            if self._held.pop(id(seq), None) is not None:
                return False  # its load never started: nothing but a forward writes that memory
            return self.connector.request_finished(seq, reason)

    def get_finished(self) -> FinishedTransfers:
        done = self.connector.get_finished()
        with self._lock:
            failed, self._failed = self._failed, {}
        done.failed.update(failed)
        return done

    # ------------------------------------------------------------------ OverlappedSteps' side
    def take(self) -> list[NotedLoad]:
        """The loads noted since the last call (engine thread), for the device thread to `start`."""
        with self._lock:
            new, self._new = self._new, []
        return new

    def start(self, loads: list[NotedLoad]) -> None:
        """On the device thread, at the step boundary: start each load whose request is still waiting
        for it. One that cannot start fails its request (reported by `get_finished`)."""
        failed = False
        for seq, num_external_tokens in loads:
            with self._lock:
                if self._held.pop(id(seq), None) is None:
                    continue  # finished before its load started
                try:
                    self.connector.update_state_after_alloc(seq, num_external_tokens)
                except Exception as e:
                    self._failed[seq.request_id] = f"the hand-off could not start: {e}"
                    failed = True
        if failed and self.connector.on_transfer_end is not None:
            self.connector.on_transfer_end()
