"""Shared helpers for the side-by-side benchmarks: timing, atomic JSON results, markdown tables."""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# `deltamoe bench --results-dir DIR` points every suite elsewhere (tests use a temp folder).
RESULTS = Path(os.environ.get("DELTAMOE_BENCH_RESULTS") or Path(__file__).parent / "results")


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    # The vector ISA torch's CPU kernels use (AVX2 vs AVX-512 changes most of these figures, and the
    # project's VMs have been either): recorded so rows measured on different hosts can be told apart.
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "vector_isa": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version()}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a bench that spawned servers stops them in its `finally`
    blocks when it is terminated (by default SIGTERM ends Python at once and orphans them)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def result_name(name: str, quick: bool) -> str:
    """Quick (smoke) runs write NAME_quick.json, which git ignores and the README table skips."""
    return f"{name}_quick" if quick else name


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "machine": machine(), **data}, indent=2))
    os.replace(tmp, path)
    return path


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
