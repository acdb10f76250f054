"""The rich progress bar of the logging rank: step, loss, accuracy, tokens/s."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from deltamoe.plain_progress import PlainProgress


class RunProgress:
    def __init__(self, total: int, start: int, enabled: bool):
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        self._plain: PlainProgress | None = None
        self._eval = ""
        self._total = total
        self._status = ""  # the last step's status, without the evaluation
        self._last: tuple[int, str] | None = None  # plain output: the last step's line, held for its evaluation
        if not enabled:
            return
        if not self.console.is_terminal:  # a live bar would draw nothing until the end
            self._plain = PlainProgress("train", total, self.console)
            return
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=self.console, transient=False)
        self._task = self._progress.add_task("train", total=total, completed=start, status="")
        self._progress.start()

    def update(self, step: int, record: dict) -> None:
        # An RL step whose groups were all dropped or too small trains nothing: it has no loss.
        loss = record.get("loss")
        head = f"loss {loss:.4f}" if loss is not None else "no update (no group of 2+ completions)"
        lm = record.get("lm_loss")
        if loss is not None and lm is not None and abs(lm - loss) > 1e-9:
            # The loss adds the MTP heads' term; the language-model part is what an eval loss compares with.
            head += f" (lm {lm:.4f})"
        status = f"{head}  {record['tokens_per_s']:,.0f} tok/s"
        if self._plain is not None:
            if step >= self._total:  # printed at close, with the closing evaluation's numbers
                self._last = (step, status)
            else:
                self._plain.update(step, status + self._eval)
        self._status = status
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status + self._eval)

    def evaluated(self, result: dict) -> None:
        loss, acc = result.get("loss"), result.get("accuracy")
        self._eval = (f"  eval {loss:.4f}" if loss is not None else "") + (f" acc {acc:.1%}" if acc is not None else "")
        if self._progress is not None:  # the bar shows this step's evaluation, not the previous one's
            self._progress.update(self._task, status=self._status + self._eval)

    def close(self) -> None:
        if self._plain is not None and self._last is not None:
            self._plain.update(self._last[0], self._last[1] + self._eval)
        if self._plain is not None:
            self._plain.close()
            self._plain = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
