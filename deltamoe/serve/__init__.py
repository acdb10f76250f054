"""Serving: a continuous-batching engine (`engine/`) and the OpenAI-compatible HTTP server on it (`api/`).

`engine/` is everything that runs requests: LLMEngine, its scheduler (policy), cache (memory),
runner (device), sampling, outputs, the compiled decode graph, and AsyncLLMEngine, the thread that
drives an LLMEngine for concurrent callers. `api/` is the HTTP side only (FastAPI app, OpenAI
schemas, request params, error bodies, response formatting, metrics, chat template); it imports
`engine/`, never the other way round. `executor/` carries the runner's work to the devices: this
process, or tp x ep worker ranks (`WorkerConfig`). `spec_decode/` drafts tokens with the model's
MTP layer and verifies them in one forward (`EngineConfig.speculative`); `kv_transfer/` moves
caches between prefill and decode servers.

The common names are importable from here (`from deltamoe.serve import LLMEngine`); they load on
first use, so `import deltamoe.serve.engine.config` (the CLI's startup) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "LLMEngine": "deltamoe.serve.engine.llm_engine",
    "AsyncLLMEngine": "deltamoe.serve.engine.async_engine",
    "EngineConfig": "deltamoe.serve.engine.config",
    "SamplingParams": "deltamoe.serve.engine.sampling",
    "Completion": "deltamoe.serve.engine.outputs",
    "RequestOutput": "deltamoe.serve.engine.outputs",
    "EngineStats": "deltamoe.serve.engine.outputs",
    "ChatTemplate": "deltamoe.serve.api.chat_template",
    "WorkerConfig": "deltamoe.serve.executor.config",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'deltamoe.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
