"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLMEngine`.

Routes: GET /health, GET /metrics (Prometheus), and under /v1 (Bearer key, when one is set):
GET /models, POST /completions, POST /chat/completions (SSE streaming or one JSON body); and vLLM's
POST /tokenize and POST /detokenize at the root (behind the key too).

The flow per request: the key is checked -> the body is parsed strictly (`api_schemas`) ->
the model name is checked -> fields become SamplingParams (`api_params`) -> the engine runs
it (`api_generate`) -> outputs become OpenAI objects (`api_format`). Any failure on the way
is an OpenAI-style error body (`api_errors`); none of them takes the server down.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.middleware.cors import CORSMiddleware

from deltamoe.errors import RequestError
from deltamoe.serve.api.chat_request import ChatOptions, opens_thinking
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.choices import respond_choices, wants_choices
from deltamoe.serve.api.echo import EchoCompletionFormatter
from deltamoe.serve.api.images import ImageOptions
from deltamoe.serve.api.connections import (AcceptErrorLog, EndingServer, HTTPLimits, raise_open_file_limit,
                                            uvicorn_config)
from deltamoe.serve.api.auth import bearer_check, check_api_key_option
from deltamoe.serve.api.body import MAX_BODY_BYTES, read_body
from deltamoe.serve.api.errors import APIError, InternalErrorMiddleware, install_error_handlers
from deltamoe.serve.api.format import ChatFormatter, CompletionFormatter
from deltamoe.serve.api.generate import Generation
from deltamoe.serve.api.openapi import install_openapi
from deltamoe.serve.api.reasoning_parser import reasoning_first
from deltamoe.serve.api.metrics import CONTENT_TYPE, HTTPMetricsMiddleware, ServerMetrics
from deltamoe.serve.api.params import chat_params, completion_params
from deltamoe.serve.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields
from deltamoe.serve.api.tokenize import tokenize_router
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.structured.request import constrain

def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _continuous_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def build_app(engine: AsyncLLMEngine, model_name: str, *, api_key: str | None = None,
              chat_template: ChatTemplate | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout_s: float = HTTPLimits.body_timeout_s,
              hand_off: Callable[[Request], object | None] | None = None,
              routers: Sequence[APIRouter] = (), image_options: ImageOptions = ImageOptions(),
              allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app for one engine serving one model name. The engine thread runs for the app's lifespan.
    `allowed_origins`: browser origins allowed to call it (CORS); none by default, since any web page
    a user opens could otherwise drive a server on their machine (vLLM allows every origin).
    `hand_off`: a request's KV-connector parameters from its headers (a decode server of a P/D
    pair, `serve/kv_transfer/roles.py`); `routers`: extra routes (a role's internal ones);
    `image_options`: which image sources chat requests may use (`serve/api/images.py`)."""
    template = chat_template or ChatTemplate.for_model(engine.tokenizer, None)
    metrics = ServerMetrics(engine.stats, engine.rank_stats)
    vocab_size = engine.model_config.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        AcceptErrorLog(asyncio.get_running_loop()).install()
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="deltamoe", summary="OpenAI-compatible server for the Kimi Linear / K3 family",
                  lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)  # added last = outermost: it sees every status
    app.state.engine, app.state.metrics = engine, metrics

    check_key = bearer_check(check_api_key_option(api_key))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return APIError(503, engine.unavailable_reason, code="engine_not_running").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format."}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def _hand_off(request: Request) -> object | None:
        return hand_off(request) if hand_off is not None else None

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)])

    @v1.get("/models/{model_id:path}")  # `client.models.retrieve`; :path, as model names may hold a slash
    async def model(model_id: str) -> ModelCard:
        check_model(model_id)
        return ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await read_body(request, CompletionRequest, max_body_bytes, body_timeout_s)
        check_model(req.model)
        req.model = req.model or model_name  # omitted: the served model, as vLLM
        params, names = completion_params(req, vocab_size)
        await constrain(params, req, engine.tokenizer)
        cmpl_id, prompts = f"cmpl-{uuid.uuid4().hex}", req.prompts

        def formatter(b: int) -> CompletionFormatter:  # for a choice of prompt b
            if req.echo or req.prompt_logprobs is not None:  # the prompt's text and logprobs too (api/echo.py)
                return EchoCompletionFormatter(cmpl_id, req.model, engine.tokenizer, req, prompts[b])
            return CompletionFormatter(cmpl_id, req.model, engine.tokenizer, req.logprobs is not None)

        gen = Generation(engine, metrics, names, _continuous_usage(req))
        if wants_choices(req, len(prompts)):  # n > 1, best_of > 1 or several prompts: a prefill a prompt
            return await respond_choices(gen, request, req, prompts, params, formatter, _include_usage(req),
                                         _hand_off(request))
        fmt = formatter(0)
        return await gen.respond(request, req.prompt, params, fmt, bool(req.stream), _include_usage(req),
                                 _hand_off(request))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_body(request, ChatCompletionRequest, max_body_bytes, body_timeout_s)
        check_model(req.model)
        req.model = req.model or model_name  # omitted: the served model, as vLLM
        params, names = chat_params(req, vocab_size, template.stop_token_ids)
        options = ChatOptions.of(req, template)
        await constrain(params, req, engine.tokenizer)  # response_format, guided_*, a forced tool_choice
        prompt, images = await options.encode_with_images(template, [m.model_dump() for m in req.messages],
                                                          req.add_generation_prompt, engine.model_config,
                                                          image_options)
        if params.structured is not None and options.thinking and opens_thinking(prompt, engine.tokenizer):
            # The model reasons first: the constraint holds for the answer, after `</think>` (as vLLM's
            # structured outputs with a reasoning parser), not for the reasoning.
            params.structured = reasoning_first(params.structured)
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"

        def formatter() -> ChatFormatter:  # one per choice: each output parser keeps its own state
            return ChatFormatter(chat_id, req.model, engine.tokenizer, bool(req.logprobs),
                                 options.parser(prompt, params, engine.tokenizer), req.prompt_logprobs is not None)

        gen = Generation(engine, metrics, names, _continuous_usage(req))
        if wants_choices(req):
            return await respond_choices(gen, request, req, [prompt], params, lambda _: formatter(),
                                         _include_usage(req), _hand_off(request), images or None)
        return await gen.respond(request, prompt, params, formatter(), bool(req.stream), _include_usage(req),
                                 _hand_off(request), images=images or None)

    app.include_router(v1)
    app.include_router(tokenize_router(engine, template, check_model,
                                       lambda r, schema: read_body(r, schema, max_body_bytes, body_timeout_s),
                                       image_options),
                       dependencies=[Depends(check_key)])
    for router in routers:
        app.include_router(router, dependencies=[Depends(check_key)])
    install_openapi(app)
    if allowed_origins:  # browsers' preflight (OPTIONS) and the Access-Control-* headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def run(engine: AsyncLLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000, *,
        api_key: str | None = None, chat_template: ChatTemplate | None = None, log_level: str = "info",
        sock: socket.socket | None = None, limits: HTTPLimits = HTTPLimits(),
        hand_off: Callable[[Request], object | None] | None = None, routers: Sequence[APIRouter] = (),
        image_options: ImageOptions = ImageOptions(), allowed_origins: Sequence[str] = ()) -> None:
    """Serve until Ctrl-C (blocking). `sock`: an already bound socket for host:port (the CLI binds
    it before loading the model); None binds here."""
    raise_open_file_limit()
    app = build_app(engine, model_name, api_key=api_key, chat_template=chat_template, hand_off=hand_off,
                    routers=routers, image_options=image_options, allowed_origins=allowed_origins)
    config = uvicorn_config(app, host, port, log_level, limits)
    EndingServer(config, lambda: engine.end_all("the server is shutting down")).run(
        sockets=[sock] if sock is not None else None)

