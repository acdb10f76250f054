"""HTTP routes for weight updates without a restart, in the shape of vLLM's RLHF routes.

    POST /init_weight_transfer_engine  {host, port, rank, world_size, timeout_s}
    POST /start_weight_update          {idle_timeout_s}
    POST /update_weights               {names, dtype_names, shapes, bucket_bytes}
    POST /finish_weight_update         {running: wait|abort, timeout_s} -> {version, tensors, bytes, receive_s, swap_s}
    POST /abort_weight_update
    GET  /weight_version               -> {version, updating}

Control travels over HTTP, tensors over the trainer's gloo transfer group (`weight_transfer.py`):
/update_weights checks the announced names and shapes (400 naming the first bad tensor, and the
trainer is told through the group not to send), and that the trainer's tensors take the bytes the
announced dtypes and shapes do (else nobody sends: a receive buffer of another size aborts the
process inside gloo), then receives the buckets. A malformed body closes the open update and tells
the trainer too; a failed transfer group is dropped (a 400 saying to init a new one), and a new
group is refused while an update is open on the current one. /finish_weight_update waits for the
requests running now to finish on the old weights (`running: "abort"`: aborts them instead, as
vLLM's pause without waiting does), swaps, and lets the requests that arrived meanwhile start on
the new ones; with `timeout_s` it waits at most that long for them, then withdraws the swap (409:
the update stays staged: finish again, or abort it). /abort_weight_update withdraws a swap still
waiting for running requests (the held requests go on at once). Over dead workers every route but
/weight_version answers 503. An open update that no route touches for `idle_timeout_s` (600 s by
default, from /start_weight_update; null: never) is aborted: its trainer died between two calls,
and the staged tensors would hold a model's worth of memory and refuse every other trainer's start.
Served only with `deltamoe serve --weight-updates`, behind the server's API key as the `/v1` routes are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from deltamoe.errors import RequestError
from deltamoe.serve.api.body import read_body
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.weight_transfer import DEFAULT_BUCKET_BYTES, TensorSpec
from deltamoe.serve.engine.weight_update import WeightUpdater
from deltamoe.serve.executor.base import WorkerDiedError

log = logging.getLogger("deltamoe.serve.api")
DEFAULT_IDLE_TIMEOUT_S = 600.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitTransferRequest(_Strict):
    host: str
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(300.0, gt=0)


class StartRequest(_Strict):
    # An update untouched this long is aborted (its trainer is gone); None: it stays open until finished or aborted.
    idle_timeout_s: float | None = Field(DEFAULT_IDLE_TIMEOUT_S, gt=0)


class UpdateWeightsRequest(_Strict):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def specs(self) -> list[TensorSpec]:
        for field in ("dtype_names", "shapes"):
            if len(getattr(self, field)) != len(self.names):
                raise RequestError(f"{len(getattr(self, field))} entries for {len(self.names)} names", field=field)
        return [TensorSpec(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


class FinishRequest(_Strict):
    running: Literal["wait", "abort"] = "wait"  # the requests running now: finish them first, or abort them
    timeout_s: float | None = Field(None, gt=0)  # with "wait": how long at most


def weight_update_routes(engine: AsyncLLMEngine) -> APIRouter:
    """The routes over this server's engine (one update at a time: a lock serialises them)."""
    updater = WeightUpdater(engine.engine)
    lock = asyncio.Lock()
    router = APIRouter(tags=["weight updates"])
    waiting: dict[str, concurrent.futures.Future] = {}  # "swap": the finish's run_when_idle future while it waits

    def check_workers() -> None:
        if not engine.is_running:
            raise APIError(503, engine.unavailable_reason, code="engine_not_running")

    @router.post("/init_weight_transfer_engine")
    async def init_transfer(request: InitTransferRequest) -> dict:
        check_workers()
        async with lock:
            if updater.updating:  # the open update's trainer is on the current group: it would hear nothing
                raise RequestError("an update is open on the current transfer group: finish or abort it first",
                                   field="weights")
            await asyncio.to_thread(updater.init_transfer_group, request.host, request.port, request.rank,
                                    request.world_size, request.timeout_s)
        return {"status": "ok"}

    idle = _IdleExpiry(updater, lock)

    @router.post("/start_weight_update", openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": StartRequest.model_json_schema()}}}})
    async def start(request: Request) -> dict:
        check_workers()
        body = await read_body(request, StartRequest) if await request.body() else StartRequest()
        async with lock:
            updater.start_weight_update()
            idle.opened(body.idle_timeout_s)
        return {"status": "ok"}

    @router.post("/update_weights", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": UpdateWeightsRequest.model_json_schema()}}}})
    async def update(request: Request) -> dict:
        check_workers()
        async with lock:
            try:
                body = await read_body(request, UpdateWeightsRequest)
                specs = body.specs()
            except (APIError, RequestError) as e:
                # The trainer is waiting in the agreement for this update: it must hear "no", and the
                # update must close, or it waits out its timeout and the next start is refused.
                if updater.updating and updater.group is not None:
                    rejected = e if isinstance(e, RequestError) else RequestError(e.message, field=e.param)
                    try:
                        await asyncio.to_thread(updater.update_weights, [], 0, rejected)
                    except RequestError:
                        pass
                raise
            try:
                await asyncio.to_thread(updater.update_weights, specs, body.bucket_bytes)
            finally:
                idle.touched()
        return {"status": "ok", "tensors": len(specs)}

    @router.post("/finish_weight_update", openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": FinishRequest.model_json_schema()}}}})
    async def finish(request: Request) -> dict:
        check_workers()
        body = await read_body(request, FinishRequest) if await request.body() else FinishRequest()
        async with lock:
            future = engine.run_when_idle(updater.finish_weight_update, abort_running=body.running == "abort")
            waiting["swap"] = future
            try:
                stats = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), body.timeout_s)
            except asyncio.TimeoutError:
                if await asyncio.wrap_future(engine.cancel_idle(future)):
                    raise APIError(409, f"requests were still running after {body.timeout_s:g} s: the swap is "
                                   "withdrawn and the update stays staged (finish again, with running=abort, or "
                                   "abort it)", param="timeout_s", code="requests_running") from None
                stats = await asyncio.wrap_future(future)  # it started meanwhile
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                if not future.cancelled():  # this handler itself was cancelled
                    raise
                raise APIError(409, "the update was aborted while its swap waited for running requests",
                               param="weights", code="update_aborted") from None
            except WorkerDiedError as e:
                raise APIError(503, str(e), code="engine_not_running") from None
            finally:
                waiting.pop("swap", None)
                idle.touched()  # a 409 leaves it staged: its clock starts again
        return asdict(stats)

    @router.post("/abort_weight_update")
    async def abort() -> dict:
        swap = waiting.get("swap")
        # A swap still waiting for running requests is withdrawn at once (its finish answers 409),
        # rather than this abort waiting behind it.
        if swap is not None and await asyncio.wrap_future(engine.cancel_idle(swap)):
            updater.abort_weight_update()
            idle.touched()
            return {"status": "ok", "version": updater.version}
        async with lock:
            updater.abort_weight_update()
            idle.touched()
        return {"status": "ok", "version": updater.version}

    @router.get("/weight_version")
    async def version() -> dict:
        return {"version": updater.version, "updating": updater.updating}

    return router


class _IdleExpiry:
    """Aborts an open update that no route has touched for its idle timeout (a timer on the server's
    event loop, restarted by every route that works on the update; it takes the routes' lock, so it
    never cuts into a transfer or a swap in progress)."""

    def __init__(self, updater: WeightUpdater, lock: asyncio.Lock):
        self.updater, self.lock = updater, lock
        self.timeout_s: float | None = None
        self.generation = 0  # which update the timer is for: a later one is not the expired one
        self.timer: asyncio.TimerHandle | None = None
        self.last_touch = 0.0  # event-loop time of the last call that worked on the update
        self.expiry: asyncio.Future | None = None

    def opened(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.generation += 1
        self.touched()

    def touched(self) -> None:
        loop = asyncio.get_running_loop()
        self.last_touch = loop.time()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.updater.updating and self.timeout_s is not None:
            generation = self.generation
            self.timer = loop.call_later(self.timeout_s, self._fire, generation)

    def _fire(self, generation: int) -> None:
        # The loop holds tasks weakly: keep a reference while the expiry waits for the lock.
        self.expiry = asyncio.ensure_future(self._expire(generation))

    async def _expire(self, generation: int) -> None:
        async with self.lock:
            if generation != self.generation or not self.updater.updating:
                return
            # A call that held the lock when the timer fired has touched the update since (and set a new timer).
            if self.timeout_s is None or asyncio.get_running_loop().time() - self.last_touch < self.timeout_s:
                return
            self.updater.abort_weight_update()
            self.timer = None
        log.warning("deltamoe: the open weight update was aborted after %g s with no call (its trainer is "
                    "gone?); the old weights keep serving", self.timeout_s)
