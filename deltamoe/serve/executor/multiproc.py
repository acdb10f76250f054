"""MultiprocExecutor: rank 0 of a tp * ep replica. It plans each step, tells every rank, runs its own
shard with them, and samples (the LM head's logits are whole on every rank after the vocab gather).

A dead rank never hangs the server:
- a watchdog thread polls the spawned ranks; when one exits, the executor turns unhealthy and kills
  the others, so that a collective rank 0 may be blocked in fails at once (gloo reports the closed
  connections) instead of waiting out the timeout;
- any failure inside a step (a peer gone, a collective past `WorkerConfig.timeout_s`) leaves the
  ranks out of step, so it also turns the executor unhealthy for good;
- unhealthy, `execute` raises WorkerDiedError at once; the server answers 503.
`shutdown` tells the ranks to stop, waits briefly, then kills whatever is left; it also runs at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from deltamoe.serve.engine.image_inputs import encode_pending
from deltamoe.serve.engine.prompt_logprobs import call_projections
from deltamoe.serve.engine.runner import ModelCall, ModelRunner, StepResult
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.executor.base import RankReport, WorkerDiedError
from deltamoe.serve.executor.group import RankGroup, RankStats, StepMessage, StopMessage
from deltamoe.serve.executor.image_rows import split_off_images
from deltamoe.serve.executor.placeholders import Fill
from deltamoe.serve.executor.weight_sync import WeightsMessage, load_full_weights, tp_coordinate

if TYPE_CHECKING:
    from deltamoe.serve.kv_transfer.worker_state import StepHandOffs

REPORT_INTERVAL_S = 1.0  # how often the ranks' step times are gathered (a step with report=True)
_WATCH_INTERVAL_S = 0.2
T = TypeVar("T")


class MultiprocExecutor:
    def __init__(self, runner: ModelRunner, group: RankGroup):
        self.runner, self.group = runner, group
        runner.cache.state_log = []  # every state-slot write outside a forward is replayed on the ranks
        runner.track_expert_load()
        self._dead: str | None = None
        self._closed = False
        self._stats = [RankStats(rank) for rank in range(group.world_size)]
        self._reset_pending = False  # the next step tells the ranks to start their stats afresh
        self._last_report = 0.0
        self._lock = threading.Lock()
        # One message at a time on the ranks' channels: with async scheduling the steps go out from
        # the device thread while weight updates and shutdown come from the engine's thread.
        self._control = threading.Lock()
        # A P/D role (`kv_transfer/worker_state.RankZeroHandOffs`): planned with each step, the caches that
        # reached rank 0 alone (their bytes follow the step's message) and the state slots to gather after it.
        self.hand_off = None
        self._watchdog = threading.Thread(target=self._watch, name="deltamoe-worker-watch", daemon=True)
        self._watchdog.start()
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ the step
    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        self.check_health()
        with torch.inference_mode():  # rank 0 alone runs the vision tower; the rows follow the message
            encode_pending(self.runner.model, batch.items)
        calls = self.runner.plan(batch)
        hand_offs = self.hand_off.plan(batch) if self.hand_off is not None else None
        sent, images, rows = split_off_images([c for _, c in calls])
        message = StepMessage(self.runner.cache.take_state_ops(), sent, images=images)
        if self.group.dims.tp > 1:
            projections = [call_projections(group) for group, _ in calls]
            message.projections = projections if any(projections) else None
        return self._step(message, [] if rows is None else [rows], lambda: self.runner.run(batch, calls), hand_offs)

    def execute_ahead(self, state_ops: list[tuple[int | None, int]], calls: list[ModelCall],
                      fills: list[Fill | None], earlier: torch.Tensor | None, run: Callable[[], T],
                      hand_offs: StepHandOffs | None = None,
                      projections: list[list[tuple[int, int, int]]] | None = None) -> T:
        """A step planned one step ahead (`overlap.py`'s device thread): the ranks fill the calls'
        placeholders from `earlier`, which follows the step's message (and its handed-off caches, if
        any) as a tensor broadcast."""
        self.check_health()
        sent, images, rows = split_off_images(calls)
        message = StepMessage(state_ops, sent, images=images)
        if self.group.dims.tp > 1:  # the prompt-logprob projections (the LM head is a collective)
            message.projections = projections
        image_rows = [] if rows is None else [rows]  # after the sampled ids, as the workers take them
        if earlier is None or all(fill is None for fill in fills):
            return self._step(message, image_rows, run, hand_offs)
        earlier = earlier.to(torch.long).contiguous()
        message.fills, message.earlier_rows = fills, len(earlier)
        return self._step(message, [earlier, *image_rows], run, hand_offs)

    def _step(self, message: StepMessage, tensors: list[torch.Tensor], run: Callable[[], T],
              hand_offs: StepHandOffs | None = None) -> T:
        """Tell every rank the step (its message, then its handed-off caches' bytes and `tensors`, in the
        order the workers take them), run rank 0's part (`run`, then the state gather a prefill role's
        step asks for), gather the ranks' times now and then."""
        if hand_offs is not None:  # read from rank 0's pools now: the loads landed before this step
            message.loaded, loaded = self.hand_off.pack(hand_offs)
            message.gather_slots = hand_offs.gather_slots
            tensors = loaded + tensors
        now = time.monotonic()
        message.report = report = now - self._last_report >= REPORT_INTERVAL_S
        message.reset_stats, self._reset_pending = self._reset_pending, False
        try:
            with self._control:
                self.group.broadcast(message)
                for tensor in tensors:
                    dist.broadcast(tensor, src=0)
                start = time.perf_counter()
                results = run()
                if message.gather_slots:
                    self.hand_off.after_forward(message.gather_slots)
                own = self._stats[0]
                own.last_step_seconds = time.perf_counter() - start
                own.forward_seconds_total += own.last_step_seconds
                own.steps += 1
                if report:
                    gathered = self.group.gather_stats(own)
                    self._stats = list(gathered) if gathered is not None else self._stats
                    self._last_report = now
        except Exception as e:
            # A rank that died breaks the collective before the watchdog sees it exit: name it when it has.
            self._fail(self._exited_rank(wait_s=1.0) or f"a step failed across the workers ({e})")
            raise WorkerDiedError(self._dead) from e
        return results

    def load_weights(self, tensors: dict) -> None:
        """Every rank copies its part of the new full tensors (`weight_sync`); a failure is a dead replica,
        since the ranks may now hold different weights."""
        self.check_health()
        try:
            with self._control:
                self.group.broadcast(WeightsMessage(tensors))
                tp = self.group.dims.tp
                load_full_weights(self.runner.model, tensors, tp_coordinate(self.group.mesh, tp), tp)
        except Exception as e:
            self._fail(self._exited_rank(wait_s=1.0) or f"a weight update failed across the workers ({e})")
            raise WorkerDiedError(self._dead) from e

    # ------------------------------------------------------------------ health
    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    @property
    def healthy(self) -> bool:
        return self._dead is None

    def _watch(self) -> None:
        while not self._closed and self._dead is None:
            reason = self._exited_rank()
            if reason is not None:
                self._fail(reason)
                return
            time.sleep(_WATCH_INTERVAL_S)

    def _exited_rank(self, wait_s: float = 0.0) -> str | None:
        """'worker rank r exited with code c' for the first rank that has, waiting up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.group.processes, start=1):
                code = process.poll()
                if code is not None:
                    return f"worker rank {rank} exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(_WATCH_INTERVAL_S / 4)

    def _fail(self, reason: str) -> None:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = f"the model workers are down: {reason}"
        if first and not self._closed:  # once, in the server's log too (clients get it with their 503)
            logging.getLogger("uvicorn.error").error("deltamoe: %s", self._dead)
        self._kill_workers()

    @property
    def unhealthy_reason(self) -> str | None:
        return self._dead

    # ------------------------------------------------------------------ metrics
    def forget_stats(self) -> None:
        """Start the per-rank numbers afresh: forward times and step counts (the other ranks reset theirs
        with the next step's message) and the expert load."""
        self._stats = [RankStats(rank) for rank in range(self.group.world_size)]
        self._reset_pending = True
        self._last_report = 0.0  # and the next step gathers every rank's fresh numbers
        if self.runner.expert_load is not None:
            self.runner.expert_load.zero_()

    def rank_stats(self) -> list[RankReport]:
        """Per rank: forward seconds of its steps, and the tokens routed to the experts it holds, from
        rank 0's routing (every rank routes the same tokens). Rank r holds expert slice r // tp (the
        mesh orders ranks ep-major, then tp)."""
        load = self.runner.expert_load
        tp, ep = self.group.dims.tp, self.group.dims.ep
        rows = load.tolist() if load is not None else []
        width = len(rows[0]) // ep if rows else 0
        out = []
        for s in list(self._stats):
            first = s.rank // tp * width
            out.append(RankReport(s.rank, s.steps, s.forward_seconds_total, s.last_step_seconds, first,
                                  [row[first:first + width] for row in rows]))
        return out

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        alive = self._dead is None
        with self._lock:
            self._dead = self._dead or "the model workers were shut down"
        deadline = time.monotonic() + timeout_s
        if alive and self._control.acquire(timeout=timeout_s):  # after a step still in flight, if any
            try:
                self.group.broadcast(StopMessage())
            except Exception:
                pass
            finally:
                self._control.release()
        for process in self.group.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        self._kill_workers()
        if dist.is_initialized():  # with every other rank gone, so nothing waits on them
            dist.destroy_process_group()

    def _kill_workers(self) -> None:
        for process in self.group.processes:
            if process.poll() is None:
                process.kill()
        for process in self.group.processes:
            process.wait()
