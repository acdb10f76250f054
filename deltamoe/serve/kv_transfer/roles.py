"""A server's P/D role: its connector, its internal routes, and how a decode request finds its prefill.

- prefill: `POST /internal/prefill` computes a prompt's first N-1 tokens and pushes them to the
  decode server named in the body (`prefill_service.prefill_and_push`).
- decode: a /v1 request with the header `X-DeltaMoE-Prefill-Url` (set by the router) has its
  prompt computed by that prefill server; the decode engine's connector asks for it over HTTP.
- both: `GET /internal/kv_transfer/info` reports the role, the served model name, the weights'
  fingerprint, the cache signature (model config, weights, layout, dtype, block size), the longest
  request it takes and the load, so a router checks a pairing at start-up (and again on every poll)
  and picks the least loaded worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deltamoe.errors import RequestError
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.kv_transfer.mooncake_connector import (HandOffConfig, MooncakeConnector, PrefillUnanswered,
                                                           RemotePrefill)
from deltamoe.serve.kv_transfer.mooncake_transport import TransferFailed
from deltamoe.serve.kv_transfer.prefill_service import prefill_and_push

PREFILL_HEADER = "X-DeltaMoE-Prefill-Url"  # set by the router on a decode server's /v1 requests

class HttpPrefillClient:
    """The decode side's call to a prefill server: POST {url}/internal/prefill, bounded by timeout_s.

    One `httpx.Client` for the server's life, shared by the hand-off threads (it is thread-safe):
    a client per call built an SSL context each time (tens to hundreds of milliseconds, much of it
    holding the GIL, so the engine thread's decode steps stalled with it) and opened a new
    connection to the prefill server."""

    def __init__(self, api_key: str | None = None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, limits=httpx.Limits(max_keepalive_connections=None))

    def __call__(self, url: str, payload: dict, timeout_s: float) -> dict:
        import httpx

        try:
            r = self._client.post(f"{url.rstrip('/')}/internal/prefill", json=payload, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise PrefillUnanswered(f"{type(e).__name__}: {e}") from e
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text[:200]
            raise TransferFailed(f"HTTP {r.status_code}: {message}")
        return r.json()

    def close(self) -> None:
        self._client.close()


def make_connector(role: str, host: str, timeout_s: float, api_key: str | None = None,
                   min_prompt_tokens: int = 2, staging_bytes: int = HandOffConfig.staging_bytes,
                   direct_max_segments: int = HandOffConfig.direct_max_segments,
                   inline_write_bytes: int = HandOffConfig.inline_write_bytes,
                   markers: bool = HandOffConfig.markers, weights: str = "") -> MooncakeConnector | None:
    if role == "colocated":
        return None
    client = HttpPrefillClient(api_key) if role == "decode" else None
    config = HandOffConfig(host=host, timeout_s=timeout_s, min_prompt_tokens=min_prompt_tokens,
                           staging_bytes=staging_bytes, direct_max_segments=direct_max_segments,
                           inline_write_bytes=inline_write_bytes, markers=markers, weights=weights)
    return MooncakeConnector(config, prefill_client=client)


def decode_hand_off(request: Request) -> RemotePrefill | None:
    url = request.headers.get(PREFILL_HEADER)
    return RemotePrefill(url) if url else None


def internal_routes(role: str, engine: AsyncLLMEngine, connector: MooncakeConnector | None,
                    model_name: str) -> APIRouter:
    router = APIRouter(prefix="/internal")

    @router.get("/kv_transfer/info")
    async def info() -> dict:
        s = engine.stats()
        return {"role": role, "model": model_name, "healthy": engine.is_running,
                "block_size": engine.engine.cache.block_size, "max_model_len": engine.max_model_len,
                "weights": connector.config.weights if connector else None,
                "signature": connector.descriptor.signature if connector else None,
                "session": connector.descriptor.session if connector else None,
                "load": {"running": s.num_running, "waiting": s.num_waiting, "free_blocks": s.num_free_blocks,
                         "num_blocks": s.num_blocks, **s.extra}}

    if role == "prefill":
        @router.post("/prefill")
        async def prefill(request: Request) -> JSONResponse:
            metrics = request.app.state.metrics  # a prefill server's TTFT: arrival -> prompt computed
            try:
                report = await prefill_and_push(engine, connector, await request.json())
            except RequestError as e:
                return JSONResponse({"error": {"message": e.one_line(), "code": "bad_hand_off"}}, status_code=400)
            except TransferFailed as e:
                metrics.finished.labels("hand_off_failed").inc()
                return JSONResponse({"error": {"message": str(e), "code": "kv_transfer_failed"}}, status_code=502)
            metrics.finished.labels("handed_off").inc()
            metrics.ttft.observe(report["compute_seconds"])
            return JSONResponse(report)

    return router
