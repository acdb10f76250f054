"""The prefill role's one job: compute a prompt's first N-1 tokens and push them to a decode server.

Shared by the HTTP route (`roles.py`) and in-process tests: the request runs through the
engine like any other (continuous batching, chunked prefill, prefix caching), as a one-token
greedy generation of prompt[:-1] whose sampled token is discarded; the connector's
`request_finished` hook then writes its blocks and state into the decode server's pools. The
request's images (a chat prompt's) come with it, prepared by the decode server (`image_payload.py`).
The whole call ends within the hand-off's `timeout_s`.
"""

from __future__ import annotations

import asyncio
import time

from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.kv_transfer.image_payload import images_from_json
from deltamoe.serve.kv_transfer.mooncake_connector import MooncakeConnector, push_target
from deltamoe.serve.kv_transfer.mooncake_transport import TransferFailed


async def prefill_and_push(engine: AsyncLLMEngine, connector: MooncakeConnector, payload: dict) -> dict:
    """Run one hand-off request (see `MooncakeConnector.update_state_after_alloc` for its fields);
    returns {"bytes", "seconds", "segments", "num_tokens", "compute_seconds"} or raises
    (RequestError for a bad request, TransferFailed / TimeoutError for a failed hand-off)."""
    start = time.monotonic()
    token_ids, push = push_target(connector, payload)
    images = images_from_json(payload.get("images"), engine.engine.model_config.vision, len(token_ids) - 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def compute_and_write() -> dict:
        outputs = engine.generate(token_ids[:-1], params, request_id=f"prefill-{payload['transfer_id']}",
                                  kv_transfer=push, images=images)
        async for out in outputs:
            if out.finished and out.finish_reason != "length":
                raise TransferFailed(f"the prefill ended with {out.finish_reason!r}")
        computed = time.monotonic()
        report = await asyncio.wrap_future(push.done)
        return {**report, "num_tokens": len(token_ids) - 1, "compute_seconds": computed - start}

    try:
        return await asyncio.wait_for(compute_and_write(), push.timeout_s)
    except asyncio.TimeoutError as e:
        raise TransferFailed(f"the prefill and hand-off took longer than {push.timeout_s:.1f} s") from e
