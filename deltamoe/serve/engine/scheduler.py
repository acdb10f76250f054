"""Scheduler: which sequences run this step, and how many tokens each. Policy only.

One step = decodes first (one token each, most urgent first), then chunks of unfinished
prefills, then new admissions from the waiting queue, all within `max_num_batched_tokens` and
`max_num_seqs`. A prefill chunk also stops at a KDA snapshot boundary, so prefix snapshots land
exactly on block boundaries.

When the cache has no block left for a running sequence, the least urgent sequence that is not
yet in this step (highest (priority, arrival), possibly the one asking) is preempted by
recompute: its blocks and slot go back, and it rejoins the waiting queue with its tokens so
far. A request is never dropped; one that fits the cache alone always progresses, since a
sequence only ever preempts less urgent ones.

With a KV connector (prefill/decode hand-off, `serve/kv_transfer/`), an admitted sequence whose
prompt another engine computes waits in `loading` on its reserved blocks until the connector
reports the load done (then it runs) or failed (then it finishes with 'error'); a finished
sequence whose blocks a transfer still uses waits in `pinned` until that transfer ends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.sequence import Sequence, Status, urgency

if TYPE_CHECKING:
    from deltamoe.serve.kv_transfer.connector import KVConnector


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: HybridCache, connector: KVConnector | None = None):
        self.config = config
        self.cache = cache
        self.connector = connector  # loads / saves caches from / for other engines (kv_transfer/)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.loading: dict[str, tuple[Sequence, int]] = {}  # request id -> (sequence, tokens it waits for)
        self.pinned: dict[str, Sequence] = {}  # finished, but a transfer still uses its blocks and slot
        self.failed: list[tuple[Sequence, str]] = []  # loads that failed since the last `take_failed`
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.pinned)

    def schedule(self) -> ScheduledBatch:
        if self.connector is not None:
            self._end_transfers()
        batch = ScheduledBatch()
        preemptions_before = self.num_preemptions
        scheduled: set[int] = set()
        budget = self.config.max_num_batched_tokens
        by_urgency = sorted(self.running, key=urgency)
        decodes = [s for s in by_urgency if len(s.token_ids) - s.num_computed == 1]
        prefills = [s for s in by_urgency if len(s.token_ids) - s.num_computed > 1]
        block_size = self.cache.block_size
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_pending and seq.num_output_tokens + seq.num_pending >= seq.max_tokens:
                continue  # its last token is being sampled by a step in flight (executor/overlap.py)
            # A decode takes its one token (no snapshot boundary lies inside one token); with room
            # left in its last block it needs no allocation either: the common step, kept cheap.
            take = 1 if len(seq.token_ids) - seq.num_computed == 1 else self._chunk(seq, budget)
            if (take == 1 and seq.num_computed < len(seq.block_table) * block_size
                    or self._grow_or_preempt(seq, take, scheduled)):
                batch.items.append((seq, take))
                scheduled.add(id(seq))
                budget -= take
        # No admissions in a step that had to preempt: memory is short, new work would only thrash.
        can_admit = self.num_preemptions == preemptions_before
        while (can_admit and self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not self.cache.admit(seq):
                break
            external = self.connector.get_num_new_matched_tokens(seq, seq.num_computed) if self.connector else 0
            if external:
                if not self._start_load(seq, external):
                    break
                continue
            take = self._chunk(seq, budget)
            if not self.cache.grow(seq, seq.num_computed + take):
                self.cache.free(seq)
                seq.num_computed = 0
                break
            self.cache.record_admission(seq)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.items.append((seq, take))
            budget -= take
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence for good (finished or aborted) and give its memory back (once no
        transfer uses it any more)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.loading.pop(seq.request_id, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if self.connector is not None and self.connector.request_finished(seq, reason):
            self.pinned[seq.request_id] = seq
        else:
            self.cache.free(seq)

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """Sequences whose load failed (already finished with reason 'error'), with the reason."""
        failed, self.failed = self.failed, []
        return failed

    def _start_load(self, seq: Sequence, external: int) -> bool:
        """Reserve memory for `external` tokens another engine computes; the sequence waits in `loading`."""
        if not self.cache.grow(seq, seq.num_computed + external):
            self.cache.free(seq)
            seq.num_computed = 0
            return False
        self.cache.record_admission(seq)
        self.waiting.pop(0)
        self.loading[seq.request_id] = (seq, external)
        self.connector.update_state_after_alloc(seq, external)
        return True

    def _end_transfers(self) -> None:
        """Loaded sequences start running; failed loads finish with 'error'; pinned memory goes back."""
        done = self.connector.get_finished()
        for request_id in done.received:
            if request_id in self.loading:
                seq, external = self.loading.pop(request_id)
                seq.num_computed += external
                seq.status = Status.RUNNING
                self.running.append(seq)
        for request_id, reason in done.failed.items():
            if request_id in self.loading:
                seq, _ = self.loading.pop(request_id)
                self.cache.free(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                self.failed.append((seq, reason))
        for request_id in done.sent | done.received | set(done.failed):
            if (seq := self.pinned.pop(request_id, None)) is not None:
                self.cache.free(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        start = seq.num_computed
        end = self.cache.next_snapshot_boundary(seq, start, start + min(seq.num_uncomputed, budget))
        return end - start

    def _grow_or_preempt(self, seq: Sequence, take: int, scheduled: set[int]) -> bool:
        while not self.cache.grow(seq, seq.num_computed + take):
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = max(candidates, key=lambda s: s.sort_key)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
