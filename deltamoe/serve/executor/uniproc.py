"""UniprocExecutor: the model runs in this process (the default; one device)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from deltamoe.serve.engine.runner import ModelRunner, StepResult
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.executor.base import RankReport
from deltamoe.serve.executor.weight_sync import load_full_weights

T = TypeVar("T")


class UniprocExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        return self.runner.execute(batch)

    def execute_ahead(self, state_ops, calls, fills, earlier, run: Callable[[], T], hand_offs=None,
                      projections=None) -> T:
        return run()  # no other rank to tell

    healthy = True
    unhealthy_reason = None
    hand_off = None  # a role's hand-offs land in this process's cache: nothing to pass on

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def load_weights(self, tensors: dict) -> None:
        load_full_weights(self.runner.model, tensors)

    def rank_stats(self) -> list[RankReport]:
        return []

    def forget_stats(self) -> None:
        return None
