"""Find the benchmark scripts in the repository's bench/ folder and run them, one process each.

bench/ sits next to the package in a source checkout, not inside it: a wheel install has no
suites to run, and we say so by naming the folder we looked in.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deltamoe.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_ENV = "DELTAMOE_BENCH_RESULTS"  # read by bench/common.py


def bench_dir(root: Path = REPO_ROOT, name: str = "bench") -> Path:
    """The bench/ folder of the source checkout this package was imported from."""
    folder = root / name
    if not any(folder.glob("bench_*.py")):
        raise ConfigError(f"no benchmark suites (bench_*.py) in {folder}", field="bench",
                          hint="run from a source checkout of deltamoe (bench/ is not part of the wheel), "
                               "or pass --bench-dir")
    return folder


@dataclass(frozen=True)
class Suite:
    name: str  # "kda" for bench/bench_kda.py
    script: Path

    @property
    def source(self) -> str:
        return self.script.read_text()

    @property
    def has_quick(self) -> bool:
        return '"--quick"' in self.source

    @property
    def summary(self) -> str:
        doc = ast.get_docstring(ast.parse(self.source)) or ""
        return doc.splitlines()[0].strip() if doc else ""


def discover(folder: Path) -> list[Suite]:
    return [Suite(p.stem.removeprefix("bench_"), p) for p in sorted(folder.glob("bench_*.py"))]


def select(suites: list[Suite], names: list[str]) -> list[Suite]:
    """The suites named (`kda`, `bench_kda` or `bench_kda.py` all work), in the order given; all if none."""
    if not names:
        return suites
    by_name = {s.name: s for s in suites}
    chosen = []
    for raw in names:
        name = Path(raw).stem.removeprefix("bench_")
        if name not in by_name:
            raise ConfigError(f"unknown suite {raw!r}; expected one of {', '.join(by_name)}", field="NAMES")
        chosen.append(by_name[name])
    return chosen


@dataclass
class SuiteRun:
    suite: Suite
    returncode: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_suite(suite: Suite, quick: bool, results_dir: Path | None = None) -> SuiteRun:
    """Run one script with this Python; its output streams through. A crash only fails this suite."""
    cmd = [sys.executable, str(suite.script)] + (["--quick"] if quick and suite.has_quick else [])
    env = dict(os.environ)
    if results_dir is not None:
        env[RESULTS_ENV] = str(results_dir.resolve())
    start = time.perf_counter()
    rc = subprocess.run(cmd, cwd=suite.script.parent.parent, env=env).returncode
    return SuiteRun(suite, rc, time.perf_counter() - start)
