"""HTTP routes for weight updates without a restart, in the shape of vLLM's RLHF routes.

    POST /init_weight_transfer_engine  {host, port, rank, world_size, timeout_s}
    POST /start_weight_update
    POST /update_weights               {names, dtype_names, shapes, bucket_bytes}
    POST /finish_weight_update         -> {version, tensors, bytes, receive_s, swap_s}
    POST /abort_weight_update
    GET  /weight_version               -> {version, updating}

Control travels over HTTP, tensors over the trainer's gloo transfer group (`weight_transfer.py`):
/update_weights checks the announced names and shapes (400 naming the first bad tensor, and the
trainer is told through the group not to send), and that the trainer's tensors take the bytes the
announced dtypes and shapes do (else nobody sends: a receive buffer of another size aborts the
process inside gloo), then receives the buckets. A malformed body closes the open update and tells
the trainer too; a failed transfer group is dropped (a 400 saying to init a new one). /finish_weight_update
waits for the requests running now to finish on the old weights, swaps, and lets the requests
that arrived meanwhile start on the new ones. Served only with `deltamoe serve --weight-updates`,
behind the server's API key like every other route.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from deltamoe.errors import RequestError
from deltamoe.serve.api.body import read_body
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.weight_transfer import DEFAULT_BUCKET_BYTES, TensorSpec
from deltamoe.serve.engine.weight_update import WeightUpdater


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitTransferRequest(_Strict):
    host: str
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(300.0, gt=0)


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


def weight_update_routes(engine: AsyncLLMEngine) -> APIRouter:
    """The routes over this server's engine (one update at a time: a lock serialises them)."""
    updater = WeightUpdater(engine.engine)
    lock = asyncio.Lock()
    router = APIRouter(tags=["weight updates"])

    @router.post("/init_weight_transfer_engine")
    async def init_transfer(request: InitTransferRequest) -> dict:
        async with lock:
            await asyncio.to_thread(updater.init_transfer_group, request.host, request.port, request.rank,
                                    request.world_size, request.timeout_s)
        return {"status": "ok"}

    @router.post("/start_weight_update")
    async def start() -> dict:
        async with lock:
            updater.start_weight_update()
        return {"status": "ok"}

    @router.post("/update_weights", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": UpdateWeightsRequest.model_json_schema()}}}})
    async def update(request: Request) -> dict:
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
            await asyncio.to_thread(updater.update_weights, specs, body.bucket_bytes)
        return {"status": "ok", "tensors": len(specs)}

    @router.post("/finish_weight_update")
    async def finish() -> dict:
        async with lock:
            stats = await asyncio.wrap_future(engine.run_when_idle(updater.finish_weight_update))
        return asdict(stats)

    @router.post("/abort_weight_update")
    async def abort() -> dict:
        async with lock:
            updater.abort_weight_update()
        return {"status": "ok"}

    @router.get("/weight_version")
    async def version() -> dict:
        return {"version": updater.version, "updating": updater.updating}

    return router
