"""Parallelism on torch.distributed: FSDP2 data parallel, expert parallel all-to-all, tensor parallel
plans, pipeline stages that never cut an AttnRes block. Entry points: `ParallelDims.resolve`,
`init_distributed`, `parallelize`.

The names below load on first use: `deltamoe.parallel.dims` (the layout the CLI checks) must not pull
in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"LocalModel": "api", "ParallelModel": "api", "StepResult": "api", "ParallelDims": "dims",
          "init_distributed": "mesh", "parallelize": "compose", "split_stages": "stage_split"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'deltamoe.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"deltamoe.parallel.{_HOMES[name]}"), name)
