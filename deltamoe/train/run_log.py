"""Everything the logging rank writes about a run: the resolved configs, metrics.jsonl,
eval.jsonl / eval.json, the progress bar and the closing PNG. Other ranks get an inert one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from deltamoe.model.weights import write_json_atomic
from deltamoe.train.metrics import JsonlLog, read_jsonl, truncate_jsonl
from deltamoe.train.plots import plot_curves
from deltamoe.train.progress import RunProgress

LOGS = ("metrics.jsonl", "eval.jsonl")


class RunLog:
    def __init__(self, out: Path, enabled: bool):
        self.out, self.enabled = Path(out), enabled
        self.records: list[dict[str, Any]] = []  # this process's step records
        self._metrics: JsonlLog | None = None
        self._evals: JsonlLog | None = None
        self._progress: RunProgress | None = None

    def start(self, configs: dict[str, dict], resumed_step: int | None, total: int, progress: bool) -> None:
        """Write the configs; continue the logs of a resumed run up to its step, or start them fresh."""
        if not self.enabled:
            return
        for name, data in configs.items():
            write_json_atomic(self.out / name, data)
        for name in LOGS:
            if resumed_step is None:
                (self.out / name).unlink(missing_ok=True)
            else:  # drop what an interrupted run logged after its checkpoint
                truncate_jsonl(self.out / name, resumed_step)
        self._metrics, self._evals = JsonlLog(self.out / LOGS[0]), JsonlLog(self.out / LOGS[1])
        self._progress = RunProgress(total, resumed_step or 0, progress)

    def step(self, record: dict[str, Any], write: bool) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        if write:
            self._metrics.write(record)
        self._progress.update(record["step"], record)

    def evaluated(self, result: dict[str, Any] | None) -> None:
        if self.enabled and result is not None:
            self._evals.write(result)
            self._progress.evaluated(result)

    def close(self) -> None:
        for f in (self._metrics, self._evals, self._progress):
            if f is not None:
                f.close()
        self._metrics = self._evals = self._progress = None

    def finish(self, final_eval: dict[str, Any] | None, title: str, step: int, why_no_eval: str = "") -> None:
        """eval.json, curves.png and a one-line summary of `step`, after the logs are closed; without an
        evaluation (a data source without held-out rows) the summary says `why_no_eval`."""
        if not self.enabled:
            return
        if final_eval is not None:
            write_json_atomic(self.out / "eval.json", final_eval)
        metrics, evals = read_jsonl(self.out / LOGS[0]), read_jsonl(self.out / LOGS[1])
        if metrics:
            plot_curves(metrics, evals, self.out / "curves.png", title)
        if final_eval is not None:
            loss, acc = final_eval.get("loss"), final_eval.get("accuracy")
            text = f"step {final_eval['step']}: " + (f"eval loss {loss:.4f}" if loss is not None else "no eval loss")
            Console(stderr=True).print(text + (f", accuracy {acc:.1%}" if acc is not None else "") + f" -> {self.out}")
        else:  # the run still says where it ended and where its files are
            last = self.records[-1] if self.records else {}
            loss = f"train loss {last['loss']:.4f}" if last.get("loss") is not None else "no train loss this run"
            Console(stderr=True).print(f"step {step}: {loss}{', ' + why_no_eval if why_no_eval else ''} -> {self.out}")
