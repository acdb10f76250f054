"""The body of `deltamoe trace analyze`, free of Typer and click, and its plain argparse parser.

cli.py declares the command for the `deltamoe` CLI (Typer) and calls `run_analyze`;
`python -m deltamoe.trace analyze` parses the same options with `parser()` instead, which
costs a few ms where importing Typer, click and inspect costs ~40 ms, more than reading a
hundred rank files takes. tests/trace/test_cli.py checks both declare the same options.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from deltamoe.errors import TraceError

if TYPE_CHECKING:  # rich loads only when something is shown (~40 ms of start-up otherwise)
    from rich.console import Console
    from rich.progress import Progress

ANALYZE_HELP = "Find stragglers, pipeline bubbles, overlap and imbalance in a folder of per-rank traces."


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """'A:B' keeps ProfilerStep numbers A <= n < B; 'A:' / ':B' are open; 'A' is one step."""
    if not text:
        return None, None
    try:
        if ":" not in text:
            a = int(text)
            return a, a + 1
        lo, hi = text.split(":", 1)
        a, b = (int(lo) if lo.strip() else None), (int(hi) if hi.strip() else None)
    except ValueError:
        raise TraceError(f"cannot parse {text!r}", field="--steps", hint="use A:B, e.g. 2:5") from None
    if a is not None and b is not None and b <= a:
        raise TraceError(f"empty range {text!r}", field="--steps", hint="B must be greater than A")
    return a, b


def parse_patterns(patterns: list[str] | None) -> list[str]:
    """`--comm-pattern` regexes, each compiled here: a bad one is a usage error, not a file error."""
    import re

    for p in patterns or []:
        try:
            re.compile(p)
        except re.error as e:
            raise TraceError(f"invalid regular expression {p!r} ({e})", field="--comm-pattern") from None
    return list(patterns or [])


def progress(console: Console) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # No refresh thread: the reader forks worker processes, which must not inherit a busy lock.
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, auto_refresh=False, transient=True)


def parse_args(argv: list[str]) -> dict:
    """`analyze`'s arguments as keyword arguments of `run_analyze`; exits 2 with argparse's
    message on an error."""
    return vars(parser().parse_args(argv))


def parser():
    """`analyze`'s options as argparse declares them (same names and defaults as cli.analyze)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m deltamoe.trace analyze", description=ANALYZE_HELP,
                                allow_abbrev=False)
    p.add_argument("folder", metavar="DIR", help="folder with one Kineto trace per rank (.json / .json.gz)")
    p.add_argument("--json", dest="json_out", metavar="OUT.json", default=None, help="write the full report as JSON")
    p.add_argument("--html", dest="html_out", metavar="OUT.html", default=None, help="write a self-contained HTML report")
    p.add_argument("--workers", type=int, default=0, help="reader processes (0: one per CPU)")
    p.add_argument("--steps", metavar="A:B", default=None, help="keep ProfilerStep numbers A <= n < B")
    p.add_argument("--comm-pattern", dest="comm_pattern", action="append", default=[],
                   help="extra regex for communication kernels (other vendors)")
    p.add_argument("--quiet", action="store_true", default=False, help="no progress bar or summary")
    return p


def run_analyze(folder: str, json_out: str | None = None, html_out: str | None = None, workers: int = 0,
                steps: str | None = None, comm_pattern: list[str] | None = None, quiet: bool = False) -> None:
    from deltamoe.trace.analyze import analyze as run
    from deltamoe.trace.classify import Patterns
    from deltamoe.trace.reader import ReadConfig
    from deltamoe.trace.report import write_html, write_json

    if workers < 0:
        raise TraceError("must be >= 0", field="--workers")
    if not Path(folder).is_dir():
        raise TraceError(f"not a directory: {folder}", field="DIR",
                         hint="pass the folder that holds one trace file per rank")
    cfg = ReadConfig(patterns=Patterns().with_extra(parse_patterns(comm_pattern)), steps=parse_steps(steps))
    if quiet:
        result = run(folder, cfg, workers)
    else:
        from rich.console import Console

        with progress(Console(stderr=True)) as bar:
            task = bar.add_task("reading traces", total=None)

            def start(n: int) -> None:
                bar.update(task, total=n)
                bar.refresh()

            def done(_path: str) -> None:
                bar.advance(task)
                bar.refresh()
            result = run(folder, cfg, workers, on_file=done, on_start=start)
    if json_out:
        write_json(result.report, json_out)
    if html_out:
        write_html(result.report, result.summaries, html_out)
    if not quiet:
        from rich.console import Console

        from deltamoe.trace.terminal import print_summary

        print_summary(result.report, Console())
