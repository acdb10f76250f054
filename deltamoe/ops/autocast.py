"""Ops that compute in full precision whatever autocast region calls them.

Autocast runs matmuls in bf16/fp16 inside its region. An op whose numerics need fp32 throughout
(KDA's recurrent state, its chunked triangular solve: no bf16 kernel for that on a CPU) upcasts its
inputs itself and leaves the region for its own body; its output comes back in the caller's dtype.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def without_autocast(device_type: str) -> AbstractContextManager:
    """Autocast off on `device_type`. Entering a disabled region costs more than a small matmul,
    so this is a no-op context when no region is active."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


def full_precision(fn: F) -> F:
    """Run the op `fn` outside any autocast region on the device of its first tensor argument
    (given by position or by name)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
        with without_autocast(first.device.type):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
