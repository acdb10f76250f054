"""The router's HTTP app: OpenAI routes forwarded through prefill/decode pairs (`proxy.py`).

Routes: GET /health, GET /metrics, GET /v1/models (the workers' model), POST /v1/completions and
POST /v1/chat/completions (streaming or not). Worker loads are refreshed every `poll_s`. With an API
key, the /v1 routes ask clients for it as the workers do (the router sends it on to them). A client
gets the servers' HTTP limits here too (`serve/api/connections.py`: header and body deadlines, body
size, connection count), so the router never holds more of a body than a worker would take.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deltamoe.serve.api.auth import bearer_check, check_api_key_option
from deltamoe.serve.api.errors import APIError, install_error_handlers
from deltamoe.serve.api.metrics import CONTENT_TYPE
from deltamoe.serve.api.body import read_bytes
from deltamoe.serve.router.metrics import RouterMetrics
from deltamoe.serve.router.proxy import Proxy
from deltamoe.serve.router.workers import WorkerPool


def build_router_app(pool: WorkerPool, *, api_key: str | None = None, max_retries: int = 2,
                     read_timeout_s: float = 60.0, poll_s: float = 1.0) -> FastAPI:
    """`pool` must have passed `check` (the model name and the signature come from it)."""
    check_api_key_option(api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    metrics = RouterMetrics()
    created = int(time.time())
    state: dict = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        timeout = httpx.Timeout(connect=5.0, read=read_timeout_s, write=30.0, pool=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            state["proxy"] = app.state.proxy = Proxy(pool, client, metrics, headers, max_retries, read_timeout_s)

            async def poll():
                while True:
                    await asyncio.sleep(poll_s)
                    await pool.refresh(client)

            task = asyncio.create_task(poll())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title="deltamoe router", lifespan=lifespan)
    app.state.metrics, app.state.pool, app.state.proxy = metrics, pool, None

    @app.get("/health")
    async def health() -> Response:
        # 503 while a role has no available worker: a load balancer then stops sending what would fail.
        down = [role for role, up in pool.serving_roles().items() if not up]
        return JSONResponse({"status": "ok" if not down else f"no available {' or '.join(down)} server",
                             "workers": [pool.describe(w) for w in pool.workers]},
                            status_code=503 if down else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_check(api_key))])

    def card() -> dict:
        out = {"id": pool.model, "object": "model", "created": created, "owned_by": "deltamoe"}
        if pool.max_model_len is not None:  # as the workers' cards say it
            out["max_model_len"] = pool.max_model_len
        return out

    @v1.get("/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [card()]})

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != pool.model:
            raise APIError(404, f"the model {model_id!r} does not exist; this router serves {pool.model!r}",
                           param="model", code="model_not_found")
        return JSONResponse(card())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_bytes(request)
        return await state["proxy"].forward("/v1/completions", body, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_bytes(request)
        return await state["proxy"].forward("/v1/chat/completions", body, request)

    app.include_router(v1)
    install_error_handlers(app)
    return app


def run(pool: WorkerPool, host: str, port: int, sock: socket.socket | None = None, log_level: str = "info",
        **options) -> None:
    from deltamoe.serve.api.connections import EndingServer, HTTPLimits, raise_open_file_limit, uvicorn_config

    app = build_router_app(pool, **options)
    raise_open_file_limit()  # each client stream holds two sockets here: its own and its decode server's
    # A client's connection and its relay to a decode server: the cap counts both against the file limit.
    config = uvicorn_config(app, host, port, log_level, HTTPLimits(sockets_per_connection=2))

    def end_streams() -> None:
        if app.state.proxy is not None:
            app.state.proxy.closing = True

    EndingServer(config, end_streams).run(sockets=[sock] if sock is not None else None)
