"""`python -m deltamoe.trace analyze|synth ...`: the trace commands without the rest of the CLI.

The top-level `deltamoe` command registers every subsystem (some import torch, seconds of
start-up); the analyzer needs none of them, so benchmarks and scripts can call this entry.
It parses with the same argparse parsers as `deltamoe trace` (command.py).
"""

from __future__ import annotations

import os
import sys

# The analyzer never multiplies matrices: without this, importing numpy starts one OpenBLAS
# thread per core, whose spinning costs ~70 ms of CPU that the reader processes need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from deltamoe.trace.command import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    code = main(sys.argv[1:])
    if sys.argv[1:2] == ["analyze"]:
        # The report is written and closed: skip the interpreter's teardown (freeing every
        # summary, array and module one by one: ~10-20 ms after a few hundred ranks).
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    sys.exit(code)
