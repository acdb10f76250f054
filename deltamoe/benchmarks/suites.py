"""Find the benchmark scripts in a source checkout's bench/ folder and run them, one process each.

The suites are not part of the package: they compare deltamoe with peers it does not depend on
(transformers, flash-linear-attention, HTA) and write bench/results/ and the README table of
the checkout they sit in. So `deltamoe bench` works where `pytest` does, at the root of a
checkout (bench/ of the working directory), or on the folder `--bench-dir` names, and says
which folder it looked in when there are no suites.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deltamoe.errors import ConfigError

RESULTS_ENV = "DELTAMOE_BENCH_RESULTS"  # read by bench/common.py


def bench_dir(folder: Path | None = None) -> Path:
    """The suites' folder: `folder` (--bench-dir), else bench/ in the working directory."""
    folder = (folder if folder is not None else Path.cwd() / "bench").resolve()
    if not any(folder.glob("bench_*.py")):
        raise ConfigError(f"no benchmark suites (bench_*.py) in {folder}", field="bench",
                          hint="run `deltamoe bench` at the root of a deltamoe source checkout "
                               "(the suites are not part of the installed package), or pass --bench-dir")
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
        """The docstring's first sentence, whole even when it runs over several lines."""
        doc = ast.get_docstring(ast.parse(self.source)) or ""
        paragraph = " ".join(doc.split("\n\n")[0].split())
        sentence = re.match(r"(.+?[.!?])(\s|$)", paragraph)
        return sentence.group(1) if sentence else paragraph


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
