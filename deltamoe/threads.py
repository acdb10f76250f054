"""How many torch threads a command computes with: one policy for train, generate, chat, serve, demo.

Torch's default is one intra-op thread per core. On a machine other processes also use, those
threads wait for each other at every op (OpenMP threads spin, then sleep, at each barrier), and a
step takes many times longer than with fewer threads: measured on two cores beside other work,
training steps took 1.2-38 s with torch's default against 2-4 s with one thread, and a chat
answer 71 s against 15 s. So the default counts only the cores this process may use (its CPU
affinity and its cgroup's CPU quota) that other work is not already keeping busy (the one-minute
load average), shares them among the processes of one launch (torchrun's LOCAL_WORLD_SIZE), and
keeps the cores a command reserves (a server's HTTP front end). OMP_NUM_THREADS, when set, is the
user's choice and wins over the default; `--threads` wins over both.

This module imports no torch: the CLI calls `choose_threads` before loading anything, so a bad
`--threads` or OMP_NUM_THREADS is a one-line error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from deltamoe.errors import ConfigError

THREADS_HELP = ("torch threads (default: OMP_NUM_THREADS if set, else the cores this process may use that "
                "other work leaves idle, at least 1)")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 `cpu.max`, else v1 cfs files); None: no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's quota (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def busy_cores() -> int:
    """Cores other work keeps busy: the one-minute load average, rounded to the nearest core."""
    try:
        return round(os.getloadavg()[0])
    except OSError:  # no load average on this platform
        return 0


def choose_threads(requested: int | None = None, *, reserve: int = 0, env: Mapping[str, str] | None = None,
                   cores: int | None = None, busy: int | None = None) -> int:
    """The thread count for one process: `requested` (a `--threads` value), else OMP_NUM_THREADS,
    else the idle cores this process may use, shared among torchrun's LOCAL_WORLD_SIZE processes,
    less `reserve` (kept for other threads of the command), and always between 1 and the cores.

    `cores` and `busy` default to `available_cores()` and `busy_cores()` (tests pass their own)."""
    env = os.environ if env is None else env
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"expected a positive number of threads, got {requested!r}", field="threads")
        return requested
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ConfigError(f"expected a positive integer, got {omp!r}", field="OMP_NUM_THREADS")
        return int(omp)
    cores = available_cores() if cores is None else cores
    busy = busy_cores() if busy is None else busy
    processes = _local_processes(env)
    idle = min(cores, cores - busy)  # a load above the core count leaves none idle: then one thread
    return max(1, idle // processes - reserve)


def apply_threads(threads: int) -> int:
    """Sets torch's intra-op threads (imports torch); returns the count for messages."""
    import torch

    torch.set_num_threads(threads)
    return threads


def _local_processes(env: Mapping[str, str]) -> int:
    value = env.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) >= 1 else 1
