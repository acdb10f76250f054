"""`--profile-steps A:B`: one Kineto trace per rank of steps A..B-1, for `deltamoe trace analyze`.

torch.profiler's schedule does the windowing; the trace lands as `traces/rank{r}.json`,
written atomically. The trace analyzer takes the rank from the trace's `distributedInfo`,
which Kineto only writes under an initialised process group, so a single-process run gets
`{"rank": 0, "world_size": 1}` added. Kineto numbers `ProfilerStep#N` from the profiler's start;
the trace's top-level `profiler_step_offset` (the training step of ProfilerStep#0) lets the
analyzer report and select the training steps `--profile-steps` named.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Call `step()` after every training step; inert when no window is set."""

    def __init__(self, window: tuple[int, int] | None, first_step: int, out: Path, rank: int):
        self._prof: profile | None = None
        self._first_step = first_step
        self._stack = contextlib.ExitStack()
        if window is None:
            return
        a, b = window
        a = max(a, first_step)
        if a >= b:  # the window lies before a resumed run's first step
            return
        self.path = Path(out) / "traces" / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        before = a - first_step  # profiler steps to skip before the window
        # One warmup step when there is room: the first recorded step is otherwise inflated.
        warmup = 1 if before >= 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with warnings.catch_warnings():  # no room for a warmup step is a choice here, not a mistake to flag
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            steps = schedule(wait=before - warmup, warmup=warmup, active=b - a, repeat=1)
        self._prof = profile(activities=activities, record_shapes=False, schedule=steps, on_trace_ready=self._write)
        with _without_kineto_notices():
            self._stack.enter_context(self._prof)

    def _write(self, prof: profile) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        trace["profiler_step_offset"] = self._first_step
        if not (dist.is_available() and dist.is_initialized()):
            trace.setdefault("distributedInfo", {"backend": "", "rank": 0, "world_size": 1})
        tmp.write_text(json.dumps(trace))
        os.replace(tmp, self.path)

    def step(self) -> None:
        if self._prof is not None:
            with _without_kineto_notices():
                self._prof.step()

    def close(self) -> None:
        with _without_kineto_notices():
            self._stack.close()
        self._prof = None


@contextlib.contextmanager
def _without_kineto_notices() -> Iterator[None]:
    """Kineto's C++ side prints `USDT: ... profiler_start` / `profiler_stop` notices on the
    process's stderr at every window edge (KINETO_LOG_LEVEL does not silence them); they would
    land in the middle of a progress bar. Route fd 2 through a temporary file while the profiler
    changes state and pass every other line on unchanged."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)
