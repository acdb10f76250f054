"""Settings for every test process.

The default suite runs under pytest-xdist with one worker per core (pyproject addopts): each
worker gets its share of the cores for torch's threads, so the workers together never start
more threads than there are cores (a subprocess a test starts picks its own, by deltamoe's
thread policy)."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
