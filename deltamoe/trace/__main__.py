"""`python -m deltamoe.trace analyze|synth ...`: the trace commands without the rest of the CLI.

The top-level `deltamoe` command registers every subsystem (some import torch, seconds of
start-up); the analyzer needs none of them, so benchmarks and scripts can call this entry.
Errors print as one line and exit with code 2, as `deltamoe` does.
"""

from __future__ import annotations

import sys

import click

from deltamoe.errors import DeltaMoEError
from deltamoe.trace.cli import app


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False, prog_name="python -m deltamoe.trace")
    except DeltaMoEError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    except click.ClickException as e:
        e.show()
        return 2
    except click.exceptions.Exit as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
