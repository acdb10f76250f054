"""`python -m deltamoe.trace analyze|synth ...`: the trace commands without the rest of the CLI.

The top-level `deltamoe` command registers every subsystem (some import torch, seconds of
start-up); the analyzer needs none of them, so benchmarks and scripts can call this entry.
It also skips Typer's argument parsing: Typer builds a pydantic adapter per parameter at
parse time (~0.1-0.2 s, more than analysing a few hundred ranks takes), so the same
command functions of cli.py are wrapped here as plain click commands, read from their
signatures. Errors print as one line and exit with code 2, as `deltamoe` does.

`analyze` itself (the command benchmarks time) goes further: its options are parsed by
argparse (command.parser(), the same options) and click, Typer and inspect are never
imported, ~40 ms of start-up. Help and every other command take the click path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# The analyzer never multiplies matrices: without this, importing numpy starts one OpenBLAS
# thread per core, whose spinning costs ~70 ms of CPU that the reader processes need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from deltamoe.errors import DeltaMoEError


def click_command(fn: Callable):
    """A click command with the arguments and options declared in a Typer command's signature."""
    import inspect
    import typing

    import click
    from typer.models import ArgumentInfo, OptionInfo

    hints = typing.get_type_hints(fn)
    params: list[click.Parameter] = []
    for name, p in inspect.signature(fn).parameters.items():
        info, hint = p.default, hints[name]
        many = typing.get_origin(hint) is list
        kind = typing.get_args(hint)[0] if many else hint
        required = info.default is ...
        if isinstance(info, ArgumentInfo):
            params.append(click.Argument([name], type=kind, required=required, metavar=info.metavar))
            continue
        assert isinstance(info, OptionInfo), name
        decls = [*(info.param_decls or [f"--{name.replace('_', '-')}"]), name]
        if kind is bool:
            params.append(click.Option(decls, is_flag=True, default=bool(info.default), help=info.help))
        else:
            params.append(click.Option(decls, type=kind, multiple=many, required=required,
                                       default=None if required else info.default, help=info.help,
                                       metavar=info.metavar))
    return click.Command(fn.__name__, params=params, callback=fn, help=inspect.getdoc(fn))


def click_app():
    import click

    from deltamoe.trace import cli

    return click.Group("python -m deltamoe.trace", help=cli.app.info.help,
                       commands=[click_command(cli.analyze), click_command(cli.synth)])


def _fast_analyze(argv: list[str]) -> int:
    """`analyze ARGS` without click: argparse errors exit 2 after their usage line."""
    from deltamoe.trace.command import parse_args, run_analyze

    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        run_analyze(**args)
    except DeltaMoEError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["analyze"] and not {"-h", "--help"} & set(argv):
        return _fast_analyze(argv[1:])
    import click

    try:
        click_app().main(args=argv, standalone_mode=False, prog_name="python -m deltamoe.trace")
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
    code = main()
    if sys.argv[1:2] == ["analyze"]:
        # The report is written and closed: skip the interpreter's teardown (freeing every
        # summary, array and module one by one: ~10-20 ms after a few hundred ranks).
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    sys.exit(code)
