"""`trace analyze` and `trace synth`: their options (argparse, declared once) and their bodies.

Both entry points use these parsers: `deltamoe trace ...` (cli.py hands its arguments over
untouched) and `python -m deltamoe.trace ...` (__main__.py), which imports neither Typer nor
click: ~40 ms of start-up, more than reading a hundred rank files takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from deltamoe.errors import TraceError
from deltamoe.output_paths import check_output_file, check_output_folder

if TYPE_CHECKING:  # rich loads only when something is shown (~40 ms of start-up otherwise)
    from rich.console import Console
    from rich.progress import Progress

ANALYZE_HELP = "Find stragglers, pipeline bubbles, overlap and imbalance in a folder of per-rank traces."
SYNTH_HELP = "Write realistic per-rank Kineto traces (DP/TP/PP/EP, 1F1B, NCCL) plus _ground_truth.json."


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


def parser(command: str, prog: str = "python -m deltamoe.trace"):
    """The options of `analyze` or `synth`."""
    import argparse

    if command == "analyze":
        p = argparse.ArgumentParser(prog=f"{prog} analyze", description=ANALYZE_HELP, allow_abbrev=False)
        p.add_argument("folder", metavar="DIR", help="folder with one Kineto trace per rank (.json / .json.gz)")
        p.add_argument("--json", dest="json_out", metavar="OUT.json",
                       help="write the full report as JSON ('-': standard output)")
        p.add_argument("--html", dest="html_out", metavar="OUT.html",
                       help="write a self-contained HTML report ('-': standard output)")
        p.add_argument("--workers", type=int, default=0, help="reader processes (0: one per CPU)")
        p.add_argument("--steps", metavar="A:B", help="keep ProfilerStep numbers A <= n < B")
        p.add_argument("--comm-pattern", dest="comm_pattern", action="append", default=[],
                       help="extra regex for communication kernels (other vendors; repeatable)")
        p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
        return p
    p = argparse.ArgumentParser(prog=f"{prog} synth", description=SYNTH_HELP, allow_abbrev=False)
    p.add_argument("outdir", metavar="OUTDIR")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B)")
    p.add_argument("--microbatches", type=int, default=0, help="0: 2*pp with pipelines, else 2")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=0, help="expert-parallel group size (0: largest divisor of dp up to 8)")
    p.add_argument("--layers", type=int, default=2, help="layers per stage (more layers, more events)")
    p.add_argument("--straggler", type=int, action="append", default=[], help="rank to slow down (repeatable)")
    p.add_argument("--slowdown", type=float, default=1.5, help="compute time factor of stragglers")
    p.add_argument("--imbalance", metavar="RANK:FACTOR,...", help="MoE hot ranks")
    p.add_argument("--nccl-names", dest="nccl_names", default="dev", choices=("dev", "legacy"),
                   help="dev: ncclDevKernel_*, legacy: ncclKernel_*")
    p.add_argument("--p2p", default="batched", choices=("batched", "single"),
                   help="batched: coalesced kernels (batch_isend_irecv); single: isend/irecv")
    p.add_argument("--compact", action="store_true", help="compact JSON instead of Kineto's pretty layout")
    p.add_argument("--gz", action="store_true", help="write .json.gz")
    p.add_argument("--jitter", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="writer processes (0: one per CPU)")
    return p


def main(argv: list[str], prog: str = "python -m deltamoe.trace") -> int:
    """Run `analyze ...` or `synth ...`; usage errors exit 2 (argparse prints why), as
    DeltaMoEErrors do after one line."""
    import sys

    from deltamoe.errors import DeltaMoEError

    if not argv or argv[0] not in ("analyze", "synth"):
        print(f"usage: {prog} {{analyze,synth}} ...\n  analyze  {ANALYZE_HELP}\n  synth    {SYNTH_HELP}",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        args = vars(parser(argv[0], prog).parse_args(argv[1:]))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        (run_analyze if argv[0] == "analyze" else run_synth)(**args)
    except DeltaMoEError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    return 0


def parse_imbalance(spec: str | None) -> tuple[tuple[int, float], ...]:
    """'R:F[,R:F...]' gives rank R a token share F times the mean."""
    if not spec:
        return ()
    out = []
    try:
        for part in spec.split(","):
            r, f = part.split(":")
            out.append((int(r), float(f)))
    except ValueError:
        raise TraceError(f"cannot parse {spec!r}", field="--imbalance", hint="use RANK:FACTOR[,RANK:FACTOR]") from None
    return tuple(out)


def run_synth(outdir: str, ranks: int, steps: int = 4, pp: int = 1, microbatches: int = 0, tp: int = 1,
              ep: int = 0, layers: int = 2, straggler: list[int] | None = None, slowdown: float = 1.5,
              imbalance: str | None = None, nccl_names: str = "dev", p2p: str = "batched", compact: bool = False,
              gz: bool = False, jitter: float = 0.02, seed: int = 0, workers: int = 0) -> None:
    import os

    from rich.console import Console

    from deltamoe.trace.synth import SynthConfig, generate

    cfg = SynthConfig(ranks=ranks, steps=steps, pp=pp, microbatches=microbatches, tp=tp, ep=ep, layers=layers,
                      stragglers=tuple(straggler or ()), slowdown=slowdown, hot_ranks=parse_imbalance(imbalance),
                      jitter=jitter, seed=seed, nccl_names=nccl_names, compact=compact, gz=gz, p2p=p2p)
    cfg.validate()  # before the progress bar, so an error stays one line
    check_output_folder(outdir, "OUT", TraceError)
    console = Console(stderr=True)
    with progress(console) as bar:
        task = bar.add_task("writing ranks", total=ranks)

        def tick() -> None:
            bar.advance(task)
            bar.refresh()
        truth = generate(cfg, outdir, workers or min(os.cpu_count() or 1, 2), on_rank=tick)
    ev = sum(r["events"] for r in truth["ranks"])
    console.print(f"wrote {ranks} rank traces ({ev:,} events) and _ground_truth.json to {outdir}")


def _same_file(a: str, b: str) -> bool:
    """Two output paths that end up as one file: equal after resolving `..` and symlinks, or
    (both existing) hard links to one inode."""
    import os

    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def run_analyze(folder: str, json_out: str | None = None, html_out: str | None = None, workers: int = 0,
                steps: str | None = None, comm_pattern: list[str] | None = None, quiet: bool = False) -> None:
    from deltamoe.trace.analyze import analyze as run
    from deltamoe.trace.classify import Patterns
    from deltamoe.trace.reader import ReadConfig
    from deltamoe.trace.report import STDOUT, write_html, write_json

    if workers < 0:
        raise TraceError("must be >= 0", field="--workers")
    if not Path(folder).is_dir():
        raise TraceError(f"not a directory: {folder}", field="DIR",
                         hint="pass the folder that holds one trace file per rank")
    if json_out == html_out == STDOUT:
        raise TraceError("--json and --html both write to standard output ('-')", field="--html",
                         hint="send one of them to a file")
    if json_out and html_out and STDOUT not in (json_out, html_out) and _same_file(json_out, html_out):
        raise TraceError(f"--json and --html name the same file ({html_out}); the HTML would overwrite the JSON",
                         field="--html", hint="give each report its own file name")
    for option, out in (("--json", json_out), ("--html", html_out)):
        if out and out != STDOUT:  # before the analysis, not after it
            check_output_file(out, option, TraceError)
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
    try:
        if json_out:
            write_json(result.report, json_out)
        if html_out:
            write_html(result.report, result.summaries, html_out)
    except OSError as e:  # e.g. the disk filled up during the analysis
        raise TraceError(f"cannot write {e.filename or 'standard output'}: {e.strerror or e}", field="--json/--html") from None
    if not quiet:
        from rich.console import Console

        from deltamoe.trace.terminal import print_summary

        # With a report on standard output the summary goes to stderr, so stdout stays one document.
        print_summary(result.report, Console(stderr=STDOUT in (json_out, html_out)))
