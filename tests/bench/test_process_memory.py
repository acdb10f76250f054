"""bench/process_memory.py: with freed memory kept, a block freed and allocated again touches no
fresh pages; under glibc's defaults a block above the largest mmap threshold faults in every time.
Each case runs in a fresh interpreter: the allocator setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PAGES_40_MIB = 40 * 1024 * 1024 // 4096

PROGRAM = """
import json, sys
sys.path.insert(0, sys.argv[1])
from process_memory import keep_freed_memory, minor_faults
condition = keep_freed_memory() if sys.argv[2] == "steady" else "default"
faults = []
for _ in range(3):
    before = minor_faults()
    block = bytearray(40 * 1024 * 1024)  # zero-filled: every page touched
    del block
    faults.append(minor_faults() - before)
print(json.dumps({"condition": condition, "faults": faults}))
"""


def _faults(allocator: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(BENCH), allocator], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_touched_once() -> None:
    steady, default = _faults("steady"), _faults("default")
    assert steady["condition"] == "steady"
    assert steady["faults"][0] >= PAGES_40_MIB * 0.9  # the first block is fresh memory either way
    assert max(steady["faults"][1:]) < PAGES_40_MIB * 0.1  # then the heap keeps it
    assert min(default["faults"]) >= PAGES_40_MIB * 0.9  # glibc maps and unmaps it every time
