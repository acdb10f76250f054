"""The rich progress bar of the logging rank: step, loss, accuracy, tokens/s."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    def __init__(self, total: int, start: int, enabled: bool):
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        if not enabled:
            return
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=self.console, transient=False)
        self._task = self._progress.add_task("train", total=total, completed=start, status="")
        self._progress.start()
        self._eval = ""

    def update(self, step: int, record: dict) -> None:
        if self._progress is None:
            return
        status = f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s{self._eval}"
        self._progress.update(self._task, completed=step, status=status)

    def evaluated(self, result: dict) -> None:
        loss, acc = result.get("loss"), result.get("accuracy")
        self._eval = (f"  eval {loss:.4f}" if loss is not None else "") + (f" acc {acc:.1%}" if acc is not None else "")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
