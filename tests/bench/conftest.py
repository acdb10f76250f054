"""Loading a bench/ script as a module: the scripts import their neighbours (common, bench_kda,
...) by putting bench/ on sys.path, so it is there while the script's module runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture
def bench_script() -> Callable[[str], ModuleType]:
    """bench_script("kda_cost_split") -> the module of bench/kda_cost_split.py."""
    return _load
