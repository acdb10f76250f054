"""`deltamoe` command line: one typer app; each subsystem registers its own command module.

Errors of type DeltaMoEError print as one line (field, message, hint) and exit with code 2.
"""

from __future__ import annotations

import sys

import typer

from deltamoe.errors import DeltaMoEError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="deltamoe: the Kimi Linear / K3 / K3.1 family in readable PyTorch.")


def _register() -> None:
    # Each subsystem owns its command file; the imports are here so `deltamoe --help` lists them all.
    from deltamoe.benchmarks.cli import bench_command
    from deltamoe.commands.info import info
    from deltamoe.demo.command import demo_command
    from deltamoe.plan.cli import plan_command
    from deltamoe.serve.cli import chat_command, generate_command, serve_command
    from deltamoe.train.cli import train_command
    from deltamoe.trace.cli import app as trace_app

    app.command("demo")(demo_command)
    app.command("info")(info)
    app.command("plan")(plan_command)
    app.command("train")(train_command)
    app.command("serve")(serve_command)
    app.command("generate")(generate_command)
    app.command("chat")(chat_command)
    app.command("bench")(bench_command)
    app.add_typer(trace_app, name="trace", help="Analyse or synthesise per-rank PyTorch profiler traces.")


def main(argv: list[str] | None = None) -> int:
    _register()
    try:
        app(args=argv, standalone_mode=False)
    except DeltaMoEError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except Exception as e:  # usage errors: click's, or typer's own (typer >= 0.26 vendors click)
        import click

        if isinstance(e, (click.ClickException, typer.TyperException)) and hasattr(e, "show"):
            e.show()
            return getattr(e, "exit_code", 2) or 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
