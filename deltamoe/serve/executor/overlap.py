"""One-step-ahead (async) scheduling: the host schedules step N+1 while step N runs on the device.

`LLMEngine.step()` with `EngineConfig.async_scheduling` hands each scheduled batch to
`OverlappedSteps.step`, which
1. launches the batch on a device thread (one thread: steps run in launch order) and at once
   counts its tokens as computed and appends a placeholder (-1) to every sequence it samples
   (`Sequence.num_pending`), so the next `schedule()` sees each such sequence as one decode token
   ahead, exactly as after a finished step;
2. then waits for the step before it and processes its tokens (stop checks, detokenizing, outputs):
   one step late, while the step just launched runs.
A placeholder that a step takes as input is filled on the device from the previous step's sampled
ids (`draw_tokens`: no host reads them first); the host learns the ids when it collects that step.

What makes the late view safe:
- state-slot writes the scheduler makes (zeroing a new slot, copying a prefix snapshot) are only
  logged (`HybridCache.defer_state_writes`) and replayed on the device thread before the step's
  forward, after every forward launched before: a slot or block freed while a step still writes it
  is reused only by later forwards;
- a sequence that stops at step N (EOS, a stop string, an abort) was already scheduled in step N+1:
  that step's token is discarded when collected, and the placeholder dropped; `max_tokens` is seen
  ahead, so the scheduler skips a sequence whose last token is in flight;
- a sequence preempted while its step runs keeps that step's token (as the one-step engine would:
  it preempts after that token), but the step publishes no prefix blocks for it;
- steps the host must see finished before the next is scheduled run one at a time: a step after
  which a KDA prefix snapshot is taken (the copy must read the state that step leaves), and a step
  sampling with presence/frequency penalties (they read every earlier token on the host).
Tokens, seeded draws and preemption order are therefore the one-step engine's (tests/serve/executor/
test_overlap.py).

With a prefill/decode role: on the decode side a handed-off request's load starts on the device thread
at the step boundary after its memory was reserved (`held_loads.py`: after every step launched before,
and after the reservation's state-slot writes), and the request joins the first batch scheduled after
its load is done; on the prefill side a request finishes when its last step is collected, so the
connector's `request_finished` (which starts the push of its blocks and state) sees the cache that
step left, and no step in flight touches that memory (a request whose last token is in flight is not
scheduled again).

With tp * ep worker ranks (`MultiprocExecutor`) the device thread is where rank 0 tells the ranks each
step (`execute_ahead`): the step's state-slot writes and calls, placeholders included, then the
previous step's sampled ids as a tensor, from which every rank fills the placeholders alike
(`placeholders.py`). The host keeps scheduling step N+1 while the ranks run step N; only the device
thread talks to the ranks while steps are in flight.

A role over worker ranks (`kv_transfer/worker_state.py`) plans its part with each step, on the host:
- decode side: a load lands in rank 0's pools at its step boundary, and the state-slot writes replayed
  there reach the ranks too (a message without calls, before the load starts); the step that first
  runs the request names its blocks and slot, and on the device thread rank 0 packs them from its
  pools and broadcasts them after the step's message, so every rank scatters its share (the pages,
  its heads of the KDA state) before that step's forward, in the order its steps run;
- prefill side: the step that finishes a prompt names its state slots, and after that step's forward
  every rank's heads of them are gathered whole into rank 0's pools (`--tp`), before the step is
  collected, so `request_finished`, one step late, pushes the state every rank left.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltamoe.serve.engine.image_inputs import encode_pending
from deltamoe.serve.engine.outputs import RequestOutput
from deltamoe.serve.engine.prompt_logprobs import PromptScoring, call_scorings
from deltamoe.serve.engine.runner import ModelCall, sampled_rows
from deltamoe.serve.engine.sampling import SamplingParams, TokenLogprob, draw_tokens, token_logprobs
from deltamoe.serve.engine.scheduler import ScheduledBatch, Scheduler
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.executor.base import Executor
from deltamoe.serve.executor.held_loads import HeldLoads, NotedLoad
from deltamoe.serve.executor.placeholders import PLACEHOLDER, Fill, filled_inputs

if TYPE_CHECKING:
    from deltamoe.serve.kv_transfer.worker_state import StepHandOffs


@dataclass
class _Work:
    """One step as the device thread runs it: host data only, taken at launch."""

    state_ops: list[tuple[int | None, int]]
    calls: list[tuple[list[tuple[Sequence, int]], ModelCall]]
    rows: list[list[int]]  # per call, the rows it samples
    fills: list[Fill | None]  # per call
    params: list[SamplingParams]  # per sampled row
    outputs: list[list[int]]  # per sampled row: the output ids so far (read by penalties only)
    generators: list[torch.Generator]
    hand_offs: StepHandOffs | None  # with a role over worker ranks: the caches the step moves between ranks
    scorings: list[list[tuple[Sequence, PromptScoring]]]  # per call, the rows scoring prompt tokens (prompt logprobs)
    # Sampled rows whose prompt ends with choices waiting on it (n > 1): (row, those choices), whose first
    # tokens are drawn from that row's logits with their own params and generators (`engine/forks.py`).
    forks: list[tuple[int, Sequence, list[Sequence]]] = field(default_factory=list)  # (row, parent, choices)

    def projections(self) -> list[list[tuple[int, int, int]]] | None:
        """The LM-head projections the scorings make, per call (`StepMessage.projections`); None: none."""
        out = [[(s.row, *s.hidden_rows) for _, s in call if s.hidden_rows is not None] for call in self.scorings]
        return out if any(out) else None


@dataclass
class _Sampled:
    tokens: torch.Tensor | None  # [sampled rows] on the device
    host: torch.Tensor | None  # the same, copied to the host (maybe still in flight: `ready`)
    ready: object | None  # a CUDA event recorded after the copy; None on a CPU
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprob]]] = field(default_factory=list)  # (seq, first, entries)
    # (parent, choice, token, logprob)
    fork_picks: list[tuple[Sequence, Sequence, int, TokenLogprob | None]] = field(default_factory=list)

    def host_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # only this step's work, not the one launched after it
        return self.host.tolist() if self.host is not None else []


@dataclass
class _InFlight:
    items: list[tuple[Sequence, int]]
    computed_after: list[int]  # each item's num_computed once this step is done
    preemptions: list[int]  # each item's num_preemptions at launch (changed: preempted since)
    sampled: list[Sequence]  # the sequences of the sampled rows, in row order
    result: Future[_Sampled]
    alone: bool  # collected before the next step is scheduled


class OverlappedSteps:
    def __init__(self, executor: Executor, scheduler: Scheduler,
                 take_token: Callable[[Sequence, int, TokenLogprob | None], RequestOutput],
                 loads: HeldLoads | None = None):
        """`take_token`: the engine's processing of a sampled token already placed in the sequence.
        `loads`: with a prefill/decode role, the connector the scheduler was given (`held_loads.py`)."""
        self.loads = loads
        self.executor = executor
        self.runner = executor.runner
        self.scheduler = scheduler
        self.cache = executor.runner.cache
        self.take_token = take_token
        self.cache.state_log = []
        self.cache.defer_state_writes = True
        device = self.runner.device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltamoe-device",
                                        initializer=_bind_device, initargs=(device,))
        self._in_flight: _InFlight | None = None
        self._boundaries: list[Future[None]] = []  # loads started on the device thread, not yet checked

    # ------------------------------------------------------------------ the step
    def step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch `batch` (just scheduled), then process the step launched before it: its outputs."""
        outputs: list[RequestOutput] = []
        self._start_loads()
        alone = bool(batch) and self._runs_alone(batch)
        if alone and self._in_flight is not None:  # it needs every earlier token on the host
            outputs += self._collect(self._in_flight)
            self._in_flight = None
            batch.items = [item for item in batch.items if not item[0].finished]
        launched = self._launch(batch, alone) if batch else None
        if self._in_flight is not None:
            outputs += self._collect(self._in_flight)
        self._in_flight = launched
        if launched is not None and (launched.alone or not self.scheduler.has_unfinished()):
            outputs += self._collect(launched)  # nothing may be scheduled past it / nothing left to schedule
            self._in_flight = None
        for boundary in [b for b in self._boundaries if b.done()]:
            self._boundaries.remove(boundary)
            boundary.result()  # the device thread's error, if any, surfaces here
        return outputs

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _runs_alone(self, batch: ScheduledBatch) -> bool:
        cache = self.cache
        snapshots = cache.prefix_caching and bool(cache.layout.kda_layers)
        for seq, n in batch.items:
            if seq.params.presence_penalty or seq.params.frequency_penalty:
                return True
            if snapshots and cache.takes_snapshot(seq, seq.num_computed + n):
                return True
        return False

    def _start_loads(self) -> None:
        """Hand-offs the last `schedule()` reserved memory for start on the device thread once the steps
        launched before have run, after the state-slot writes logged so far (the reservations' among
        them): before the step launched next, which does not touch requests still loading."""
        loads = self.loads.take() if self.loads is not None else []
        if loads:
            self._boundaries.append(self._pool.submit(self._at_boundary, self.cache.take_state_ops(), loads))

    def _at_boundary(self, state_ops: list[tuple[int | None, int]], loads: list[NotedLoad]) -> None:
        """Worker ranks replay the same writes, in rank 0's order (a step message without calls): they hold
        every write logged by the `schedule()` that reserved the loads, other requests' too (a local
        request's prefix snapshot copy), which no later step message repeats."""
        self.executor.execute_ahead(state_ops, [], [], None, lambda: self._start_here(state_ops, loads))

    def _start_here(self, state_ops: list[tuple[int | None, int]], loads: list[NotedLoad]) -> None:
        self.cache.apply_state_ops(state_ops)
        if self.runner.device.type == "cuda":  # the steps before and these writes are only enqueued so far
            torch.cuda.current_stream(self.runner.device).synchronize()
        self.loads.start(loads)

    # ------------------------------------------------------------------ launch (host)
    def _launch(self, batch: ScheduledBatch, alone: bool) -> _InFlight:
        if any(seq.images is not None for seq, _ in batch.items):
            # The vision tower runs here, on the host, beside the step in flight (it shares no module
            # with the decoder); the planned calls carry copies of the rows, so the embeddings of images
            # the prompts have passed can go at once.
            with torch.inference_mode():
                encode_pending(self.runner.model, batch.items)
        calls = self.runner.plan(batch)
        for seq, n in batch.items:
            if seq.images is not None:
                seq.images.release_before(seq.num_computed + n)
        for _, call in calls:  # the scheduler grows these lists in place while the step runs
            call.block_tables = [list(table) for table in call.block_tables]
        rows = [sampled_rows(group) for group, _ in calls]
        sampled = [group[row][0] for (group, _), picked in zip(calls, rows) for row in picked]
        hand_off = self.executor.hand_off
        scorings = [[(group[sc.row][0], sc) for sc in call_scorings(group)] for group, _ in calls]
        forks = []
        for row, seq in enumerate(sampled):  # its prompt ends in this step: its waiting choices draw too
            if seq.forks and not seq.output_ids:
                forks.append((row, seq, seq.forks))
                seq.forks = []
        work = _Work(self.cache.take_state_ops(), calls, rows, [self._fill(call, group) for group, call in calls],
                     [s.params for s in sampled], [list(s.output_ids) for s in sampled], [s.generator for s in sampled],
                     hand_off.plan(batch) if hand_off is not None else None, scorings, forks)
        computed_after = []
        for seq, n in batch.items:
            seq.num_computed += n
            computed_after.append(seq.num_computed)
        for seq in sampled:
            seq.token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
        previous = self._in_flight.result if self._in_flight is not None else None
        result = self._pool.submit(self._run, work, previous)
        return _InFlight(list(batch.items), computed_after, [seq.num_preemptions for seq, _ in batch.items],
                         sampled, result, alone)

    def _fill(self, call: ModelCall, group: list[tuple[Sequence, int]]) -> Fill | None:
        """Where `call` takes a placeholder as input: only decode rows do (a sequence with a token in
        flight has nothing else left to compute), each from the step in flight."""
        if max(call.counts) != 1 or PLACEHOLDER not in call.token_ids:
            return None
        if self._in_flight is None:
            raise RuntimeError("a placeholder input with no step in flight")
        row_of = {id(seq): row for row, seq in enumerate(self._in_flight.sampled)}
        positions = [i for i, token in enumerate(call.token_ids) if token == PLACEHOLDER]
        return Fill(positions, [row_of[id(group[i][0])] for i in positions])

    # ------------------------------------------------------------------ run (device thread)
    @torch.inference_mode()
    def _run(self, work: _Work, previous: Future[_Sampled] | None) -> _Sampled:
        earlier = None
        if any(fill is not None for fill in work.fills):
            earlier = previous.result().tokens  # done: this thread ran it just before
        return self.executor.execute_ahead(work.state_ops, [call for _, call in work.calls], work.fills, earlier,
                                           lambda: self._run_here(work, earlier), work.hand_offs, work.projections())

    def _run_here(self, work: _Work, earlier: torch.Tensor | None) -> _Sampled:
        """This process's part of the step: replay the state writes, fill the placeholders, run, sample."""
        runner = self.runner
        self.cache.apply_state_ops(work.state_ops)
        inputs = None
        if earlier is not None:
            inputs = filled_inputs([call for _, call in work.calls], work.fills, earlier, runner.device)
        logits, _, scored = runner.last_logits(work.calls, work.rows, inputs, work.scorings)
        if logits is None:
            return _Sampled(None, None, None, [], scored)
        tokens = draw_tokens(logits, work.params, work.outputs, work.generators)
        logprobs = [token_logprobs(logits[i], int(tokens[i]), p.logprobs) if p.logprobs is not None else None
                    for i, p in enumerate(work.params)]
        host, ready = _copy_to_host(tokens)
        return _Sampled(tokens, host, ready, logprobs, scored, self._fork_picks(work, logits))

    @staticmethod
    def _fork_picks(work: _Work, logits: torch.Tensor) -> list[tuple[Sequence, Sequence, int, TokenLogprob | None]]:
        """Each waiting choice's first token, from its parent's last-prompt logits (its own seed)."""
        picks = []
        for row, parent, children in work.forks:
            rows = logits[row].expand(len(children), -1)
            drawn = draw_tokens(rows, [c.params for c in children], [[] for _ in children],
                                [c.generator for c in children]).tolist()
            picks += [(parent, child, token, token_logprobs(rows[i], token, child.params.logprobs)
                       if child.params.logprobs is not None else None)
                      for i, (child, token) in enumerate(zip(children, drawn))]
        return picks

    # ------------------------------------------------------------------ collect (host, one step late)
    def _collect(self, step: _InFlight) -> list[RequestOutput]:
        sampled = step.result.result()  # the device thread's error, if any, surfaces here
        for seq, first, entries in sampled.prompt_logprobs:
            # What extends the scored prefix: a sequence preempted and recomputed since may have
            # scored these positions again in a step planned before this one was collected.
            skip = len(seq.prompt_logprobs) + 1 - first
            if not seq.finished and 0 <= skip < len(entries):
                seq.prompt_logprobs.extend(entries[skip:])
        picks = dict(zip(map(id, step.sampled), zip(sampled.host_ids(), sampled.logprobs)))
        outputs = []
        for (seq, _), computed, preemptions in zip(step.items, step.computed_after, step.preemptions):
            if seq.finished:  # it stopped at an earlier step or was aborted: this step's work is void
                _drop_pending(seq)
                continue
            if seq.num_preemptions == preemptions:
                self.cache.commit(seq, computed)
            pick = picks.get(id(seq))
            if pick is None:
                continue
            token, logprob = pick
            seq.token_ids[len(seq.token_ids) - seq.num_pending] = token
            seq.num_pending -= 1
            outputs.append(self.take_token(seq, token, logprob))
            if seq.finished:
                _drop_pending(seq)
        for parent, child, token, logprob in sampled.fork_picks:
            # A choice keeps its first token and computes prompt and token itself (the prefix cache
            # serves the prompt's full blocks): the cache is not forked under a step in flight.
            if child.finished:
                continue
            if child.params.prompt_logprobs == parent.params.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)  # added above: the same prompt, scored
            self.scheduler.add(child)
            child.token_ids.append(token)
            outputs.append(self.take_token(child, token, logprob))
        return outputs


def _drop_pending(seq: Sequence) -> None:
    """A finished sequence forgets the placeholders of steps whose tokens are discarded."""
    if seq.num_pending:
        del seq.token_ids[len(seq.token_ids) - seq.num_pending:]
        seq.num_pending = 0
    seq.num_computed = min(seq.num_computed, len(seq.token_ids))


def _copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """Start copying the sampled ids to the host without waiting for the device (CUDA: pinned memory
    and an event the host waits on at collect time)."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _bind_device(device: torch.device) -> None:
    """The device thread's current CUDA device is the model's (events and streams are per device)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
