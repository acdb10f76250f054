"""AsyncLLMEngine: the server's front. One background thread drives `LLMEngine.step()`; coroutines stream.

Requests are validated in the caller (a bad one raises RequestError before anything is queued),
then handed to the engine thread through a command queue, so the engine itself is only ever
touched by its own thread. Outputs travel back to each request's asyncio.Queue with
`call_soon_threadsafe`. Leaving the `generate` iterator early (client disconnect, task
cancellation, `aclose`) aborts the request and frees its blocks and state slot.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch

from deltamoe.errors import RequestError
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.outputs import EngineStats, RequestOutput
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.base import RankReport, WorkerDiedError
from deltamoe.serve.executor.config import WorkerConfig


class EngineDeadError(RuntimeError):
    """The engine thread failed while running a step; the requests in it cannot finish.

    `status`: 503 when the model workers are down (nothing will run until the server restarts),
    else 500."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class RequestFailedError(EngineDeadError):
    """One request failed inside the engine (its cache hand-off did not arrive); the engine lives on."""


TRANSFER_POLL_S = 0.05  # the longest a step that only waits for hand-offs sleeps (a transfer's end wakes it)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: collections.deque[tuple[str, object]] = collections.deque()
        self._wake = threading.Event()
        if engine.connector is not None:  # a hand-off's end wakes a step that waits for it
            engine.connector.on_transfer_end = self._wake.set
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and request validation (shared counters)
        self._stats = engine.stats()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Work that needs an idle engine (a weight swap): while any waits, new requests are held back.
        self._idle_calls: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = collections.deque()
        self._held: list[object] = []

    @classmethod
    def from_pretrained(cls, source: str | Path, config: EngineConfig | None = None,
                        tokenizer: str | Path | None = None, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", workers: WorkerConfig | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_pretrained(source, config, tokenizer, dtype, device, workers))

    # ------------------------------------------------------------------ what the server reads
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The stats after the last step (a snapshot; safe from any thread)."""
        return self._stats

    def rank_stats(self) -> list[RankReport]:
        """Per-rank step times and expert load of a multi-worker replica (empty on one process)."""
        return self.engine.executor.rank_stats()

    @property
    def is_running(self) -> bool:
        """The engine thread runs and its model workers (if any) are up: /health is 200 only then."""
        return self._thread is not None and self._thread.is_alive() and self.engine.executor.healthy

    @property
    def unavailable_reason(self) -> str:
        """Why /health is not 200: the workers' state when they are down, else the engine thread's."""
        return self.engine.executor.unhealthy_reason or "the engine thread is not running"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.is_running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="deltamoe-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then the model workers (if any: a server's lifespan ends here)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        while self._idle_calls:
            self._idle_calls.popleft()[1].set_exception(RuntimeError("the engine stopped before it was idle"))
        self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       kv_transfer: object | None = None, fork_of: str | None = None,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (text deltas) until the one with `finished=True`.
        `kv_transfer`: the engine's KV connector's hand-off parameters for this request.
        `fork_of`: another choice of the same request, sent after this one, whose prefill it shares.
        `images`: the prompt's images (`LLMEngine.make_sequence`)."""
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            seq = self.engine.make_sequence(prompt, params, request_id, priority, images=images)
            seq.kv_transfer = kv_transfer
            seq.fork_of = fork_of
            if seq.request_id in self._streams:
                raise RequestError(f"{seq.request_id!r} is already running", field="request_id")
            self._streams[seq.request_id] = (asyncio.get_running_loop(), queue)
        self._send("add", seq)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(seq.request_id, None)
            if not finished:  # the consumer left early: stop the work and free the memory
                self._send("abort", seq.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort from outside the stream (the stream then ends with finish_reason 'abort')."""
        self._send("abort", request_id)

    def end_all(self, message: str) -> None:
        """End every request now with a 503-style EngineDeadError(`message`) (a server shutting down:
        its streams then close with an error event instead of being cut). Safe from any thread."""
        self._send("end_all", message)

    def run_when_idle(self, fn: Callable[[], object], abort_running: bool = False) -> concurrent.futures.Future:
        """Run `fn` on the engine thread once the requests running now have finished (`abort_running`:
        once they are aborted, at once; each ends with finish_reason "abort"); requests that arrive
        meanwhile wait and start after it. The future holds fn's result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.start()
        self._send("idle", (fn, future))
        if abort_running:
            self._send("abort_running", None)
        return future

    def cancel_idle(self, future: concurrent.futures.Future) -> concurrent.futures.Future:
        """Withdraw a `run_when_idle` call that has not started (requests held for it go on at once).
        The returned future holds True when it was withdrawn (`future` is then cancelled), False when
        it had already run or started."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._send("cancel_idle", (future, answer))
        return answer

    def _send(self, kind: str, payload: object) -> None:
        self._commands.append((kind, payload))
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if self._idle_calls and not self.engine.has_unfinished():
                self._run_idle_calls()
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail the requests in flight, free their memory
                self._fail_all(e)
                continue
            self._stats = self.engine.stats()
            for out in outputs:
                if out.finish_reason == "error":
                    error = self.engine.errors.pop(out.request_id, "the request failed")
                    self._deliver(out.request_id, RequestFailedError(error.one_line(), status=400)
                                  if isinstance(error, RequestError) else RequestFailedError(error))
                else:
                    self._deliver(out.request_id, out)
            if not outputs and self.engine.last_batch_size == 0:  # only waiting for transfers: do not spin
                self._wake.wait(TRANSFER_POLL_S)
                self._wake.clear()

    def _drain_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "idle":
                self._idle_calls.append(payload)
            elif kind == "abort_running":
                for final in self.engine.abort_all():
                    self._deliver(final.request_id, final)
            elif kind == "cancel_idle":
                future, answer = payload
                pending = [call for call in self._idle_calls if call[1] is future]
                for call in pending:
                    self._idle_calls.remove(call)
                    future.cancel()
                if pending and not self._idle_calls:  # nothing waits for an idle engine now: the held go on
                    held, self._held = self._held, []
                    self._commands.extendleft(("add", seq) for seq in reversed(held))
                answer.set_result(bool(pending))
            elif kind == "add" and self._idle_calls:
                self._held.append(payload)
            elif kind == "add":
                try:
                    self.engine.add_sequence(payload)
                except RequestError as e:
                    self._deliver(payload.request_id, e)
            elif kind == "end_all":
                ended = [seq.request_id for seq in self._held] + [out.request_id for out in self.engine.abort_all()]
                self._held = []
                for request_id in ended:
                    self._deliver(request_id, EngineDeadError(payload, status=503))
            else:
                self._held = [seq for seq in self._held if seq.request_id != payload]
                final = self.engine.abort(payload)
                if final is not None:
                    self._deliver(final.request_id, final)
        self._stats = self.engine.stats()

    def _run_idle_calls(self) -> None:
        while self._idle_calls:
            fn, future = self._idle_calls.popleft()
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
        held, self._held = self._held, []
        self._commands.extendleft(("add", seq) for seq in reversed(held))  # before newer commands, in order

    def _deliver(self, request_id: str, item: object) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _fail_all(self, error: Exception) -> None:
        if isinstance(error, WorkerDiedError):
            dead = EngineDeadError(f"the model is unavailable: {error}", status=503)
        else:
            dead = EngineDeadError(f"engine step failed: {error!r}")
        for final in self.engine.abort_all():
            self._deliver(final.request_id, dead)
        self._stats = self.engine.stats()
