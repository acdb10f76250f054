"""`deltamoe trace analyze|synth`: the top-level CLI hands the arguments to command.py's parsers.

The options are declared once, with argparse, in command.py; `python -m deltamoe.trace` uses
the same parsers without loading Typer. Help (`deltamoe trace analyze --help`) is argparse's.
"""

from __future__ import annotations

import typer

from deltamoe.trace.command import ANALYZE_HELP, SYNTH_HELP, parse_steps, parser, run_analyze, run_synth

__all__ = ["app", "parse_steps"]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Analyse per-rank PyTorch profiler traces, or synthesise some with known ground truth.")

# Every argument, --help included, goes through untouched to the argparse parser.
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


class _UsageReported(typer.TyperException):
    """An argparse usage error, already printed: the top-level CLI shows nothing more and exits 2."""

    exit_code = 2

    def show(self, file: object = None) -> None:
        pass


def _run(command: str, ctx: typer.Context) -> None:
    """Parse with command.py's parser; a DeltaMoEError reaches the top-level CLI (one line, exit 2)."""
    try:
        args = vars(parser(command, "deltamoe trace").parse_args(ctx.args))
    except SystemExit as e:  # argparse printed the help (0) or the usage error
        if e.code:
            raise _UsageReported("usage error") from None
        raise typer.Exit(0) from None
    (run_analyze if command == "analyze" else run_synth)(**args)


@app.command("analyze", help=ANALYZE_HELP, context_settings=_PASS_THROUGH, add_help_option=False)
def analyze(ctx: typer.Context) -> None:
    _run("analyze", ctx)


@app.command("synth", help=SYNTH_HELP, context_settings=_PASS_THROUGH, add_help_option=False)
def synth(ctx: typer.Context) -> None:
    _run("synth", ctx)
