"""The executor contract: how the engine's scheduled batch reaches the devices.

`LLMEngine.step()` is schedule -> `executor.execute(batch)` -> postprocess, whatever the layout:
`UniprocExecutor` runs the model in this process; `MultiprocExecutor` runs one replica over
tp * ep ranks (rank 0 is this process). Both return the same `StepResult`s for the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

from deltamoe.serve.engine.runner import ModelCall, ModelRunner, StepResult
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.executor.placeholders import Fill

if TYPE_CHECKING:
    from deltamoe.serve.kv_transfer.worker_state import RankZeroHandOffs, StepHandOffs

T = TypeVar("T")


class WorkerDiedError(RuntimeError):
    """A rank of the replica died or stopped answering: no step can run any more (HTTP 503)."""


@dataclass
class RankReport:
    """One rank of the replica, for /metrics: forward time of its steps (gathered every
    `multiproc.REPORT_INTERVAL_S`) and the tokens routed to the experts it holds (since start)."""

    rank: int
    steps: int
    forward_seconds_total: float
    last_step_seconds: float
    first_expert: int  # global id of expert_tokens' first column
    expert_tokens: list[list[int]]  # [MoE layers in layer order, experts held by this rank]


@runtime_checkable
class Executor(Protocol):
    runner: ModelRunner  # rank 0's runner: its model shard and cache
    healthy: bool  # False once no step can run any more
    unhealthy_reason: str | None  # why, when not healthy (e.g. which worker rank exited)
    # A P/D role over worker ranks: plans each step's hand-off work (`kv_transfer/worker_state.py`); else None.
    hand_off: RankZeroHandOffs | None

    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        ...

    def execute_ahead(self, state_ops: list[tuple[int | None, int]], calls: list[ModelCall],
                      fills: list[Fill | None], earlier: torch.Tensor | None, run: Callable[[], T],
                      hand_offs: StepHandOffs | None = None,
                      projections: list[list[tuple[int, int, int]]] | None = None) -> T:
        """A step rank 0 planned one step ahead (`overlap.py`, on its device thread): tell the other ranks
        (its state-slot writes, its calls, the caches `hand_offs` names, `earlier`, the previous step's
        sampled ids that `fills` put in place of its placeholders, and the prompt-logprob `projections`
        its `run` makes after each call), then `run` this process's part and return its result."""
        ...

    def check_health(self) -> None:
        """Raise WorkerDiedError when the executor can no longer run steps."""
        ...

    def shutdown(self) -> None:
        """Stop every worker process and release the process group (idempotent)."""
        ...

    def rank_stats(self) -> list[RankReport]:
        """Per-rank numbers for /metrics (empty on one process)."""
        ...

    def forget_stats(self) -> None:
        """Start the per-rank numbers afresh (after a warm-up: its made-up requests, and the compiles
        they run, are not traffic)."""
        ...

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy full tensors (model names, checked by the caller) into every rank's shard, between steps."""
        ...
