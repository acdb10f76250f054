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
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.sequence import Sequence, Status, urgency


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: HybridCache):
        self.config = config
        self.cache = cache
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
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
        while can_admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.cache.admit(seq):
                break
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
        """Remove a sequence for good (finished or aborted) and give its memory back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

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
