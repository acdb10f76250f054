"""How long the demo's training will take here and now: a few real steps, timed before it starts.

The demo trains a fixed number of steps, so its result does not depend on the machine's load, but
its duration does. The estimate runs the demo's own recipe (the public `train` entry point) for
`PROBE_STEPS` steps in a throwaway folder and scales the timings up to the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import tempfile
import time
from dataclasses import dataclass

from deltamoe.train.config import TrainConfig
from deltamoe.train.trainer import train

PROBE_STEPS = 4  # the first step pays for one-time allocations; the others give the step time
MIN_STEPS = 20  # shorter runs (smoke tests) start at once: the probe would take a good part of them


@dataclass(frozen=True)
class TrainEstimate:
    steps: int
    step_s: float  # median time of one optimizer step, after the first
    evaluation_s: float  # what one evaluation period adds: the held-out evaluation and a checkpoint
    evaluations: int

    @property
    def total_s(self) -> float:
        return self.steps * self.step_s + self.evaluations * self.evaluation_s

    def describe(self) -> str:
        evaluations = f"{self.evaluations} evaluation" + "s" * (self.evaluations != 1)
        return (f"about {self.total_s / 60:.1f} min at this machine's current speed ({self.steps} steps at "
                f"{self.step_s:.2f} s, {evaluations} at {self.evaluation_s:.1f} s)")


def estimate_training(cfg: TrainConfig) -> TrainEstimate:
    """Time `PROBE_STEPS` steps of `cfg` (same model, batch, data and threads) and scale to `cfg.run.steps`.

    The probe's closing evaluation, checkpoint and export stand in for each periodic evaluation and
    checkpoint of the real run (a slight overestimate: the real run exports once).
    """
    run = cfg.run
    with tempfile.TemporaryDirectory(prefix="deltamoe-demo-probe-") as scratch:
        probe_run = dataclasses.replace(run, out=scratch, steps=PROBE_STEPS, eval_every=0, save_every=0,
                                        profile_steps=None, resume=False, resume_from=None, max_minutes=None,
                                        target_accuracy=None, progress=False, log_every=1)
        probe = dataclasses.replace(cfg, run=probe_run)
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):  # the probe's own summary line is not the demo's
            result = train(probe)
        wall = time.perf_counter() - t0
    steps_s = [r["step_time_s"] for r in result.metrics]
    after_steps = wall - result.metrics[-1]["elapsed_s"]
    evaluations = run.steps // run.eval_every if run.eval_every else 1
    return TrainEstimate(run.steps, statistics.median(steps_s[1:]), after_steps, evaluations)
