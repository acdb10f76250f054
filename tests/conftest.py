"""Settings for every test process.

The default suite runs under pytest-xdist with one worker per core (pyproject addopts): each
worker gets its share of the cores for torch's threads, so the workers together never start
more threads than there are cores (a subprocess a test starts picks its own, by deltamoe's
thread policy).

`generate` and `serve` compile their decode step by default; the suite's commands (and the
servers tests start as subprocesses, which inherit the environment) decode eagerly unless a test
asks for --compile: a first compile takes a minute or more per model on two cores."""

from __future__ import annotations

import os

os.environ.setdefault("DELTAMOE_COMPILE_DEFAULT", "0")


def pytest_configure(config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
