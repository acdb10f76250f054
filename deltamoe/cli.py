"""`deltamoe` command line: one typer app; each subsystem registers its own command module.

Every error is one line on stderr with exit code 2: a DeltaMoEError as `error: field: message
(hint: ...)`, a usage mistake (unknown option, bad value, missing argument) as `error: message
(see 'deltamoe CMD --help')`. Registration imports only the command modules, which import
torch and the model inside their command functions, so `--help` and early errors stay fast.
"""

from __future__ import annotations

import signal
import sys
import threading

import typer

from deltamoe.errors import DeltaMoEError

PROG = "deltamoe"

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="deltamoe: the Kimi Linear / K3 / K3.1 family in readable PyTorch.")


def _register() -> None:
    # Each subsystem owns its command file; the imports are here so `deltamoe --help` lists them all.
    from deltamoe.benchmarks.cli import bench_command
    from deltamoe.commands.info import info
    from deltamoe.demo.command import demo_command
    from deltamoe.plan.cli import plan_command
    from deltamoe.quantize.cli import quantize_command
    from deltamoe.serve.cli import chat_command, generate_command, serve_command
    from deltamoe.serve.router.cli import router_command
    from deltamoe.train.cli import train_command
    from deltamoe.train.rl.cli import rl_command
    from deltamoe.trace.cli import app as trace_app

    app.command("demo")(demo_command)
    app.command("info")(info)
    app.command("plan")(plan_command)
    app.command("train")(train_command)
    app.command("rl")(rl_command)
    app.command("serve")(serve_command)
    app.command("router")(router_command)
    app.command("generate")(generate_command)
    app.command("chat")(chat_command)
    app.command("bench")(bench_command)
    app.command("quantize")(quantize_command)
    app.add_typer(trace_app, name="trace", help="Analyse or synthesise per-rank PyTorch profiler traces.")


def _usage_errors() -> tuple[type[Exception], ...]:
    """Click's usage-error classes: typer >= 0.26 vendors click as typer._click, older typer uses click."""
    try:
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:
        from click.exceptions import NoArgsIsHelpError, UsageError
    return UsageError, NoArgsIsHelpError


def usage_line(message: str, command_path: str | None) -> str:
    """A usage mistake as one line: the message with its whitespace folded, and where help is."""
    where = command_path or PROG
    return f"error: {' '.join(message.split())} (see '{where} --help')"


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def sigterm_as_ctrl_c() -> None:
    """For a command that has no SIGTERM handling of its own (generate, chat, train): SIGTERM (a service
    manager, `timeout`, a scheduler) ends it as Ctrl-C does, so its cleanup runs (worker processes
    stopped, a compiler subprocess killed), where the default action kills the process at once.
    Not for `serve`: uvicorn restores the handler it found and raises the signal again at its exit."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def check_cache_env() -> None:
    """torch's compiler caches (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`) must be folders this
    process can create and write: torch._dynamo's import (which the serving engine pulls in, compiling
    or not) fails on one that is a file or unwritable, with a long traceback."""
    import os
    from pathlib import Path

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        value = os.environ.get(name)
        if not value:
            continue
        path = Path(value)
        try:  # torch creates it on first use anyway
            path.mkdir(parents=True, exist_ok=True)
            ok = path.is_dir() and os.access(path, os.W_OK | os.X_OK)
        except OSError as e:
            raise DeltaMoEError(f"cannot create the folder {value} ({e.strerror})", field=name,
                                hint="point it at a writable folder, or unset it for torch's default") from None
        if not ok:
            raise DeltaMoEError(f"{value} is not a writable folder", field=name,
                                hint="point it at a writable folder, or unset it for torch's default")


def main(argv: list[str] | None = None) -> int:
    """Run one command; the SIGTERM handler a command installs (`sigterm_as_ctrl_c`) lasts only as long
    as it, so a program or test that calls `main` in-process gets its own handler back."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        return _main(argv)
    finally:
        if in_main_thread and signal.getsignal(signal.SIGTERM) is not previous:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    _register()
    usage_error, no_args_is_help = _usage_errors()
    try:
        check_cache_env()
        # Outside standalone mode an exit code comes back as the value: typer.Exit(n) from a command,
        # or 130 for a Ctrl-C that reached typer (a shell's `cmd && next` must not go on after it).
        code = app(args=argv, prog_name=PROG, standalone_mode=False)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            if code == 130:
                print("interrupted", file=sys.stderr)
            return code
    except DeltaMoEError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except no_args_is_help as e:  # `deltamoe` or a group with no arguments: the help is the answer
        e.show()
        return 2
    except usage_error as e:
        ctx = getattr(e, "ctx", None)
        print(usage_line(e.format_message(), ctx.command_path if ctx is not None else None), file=sys.stderr)
        return 2
    except Exception as e:  # other click errors (a missing file for a typer.Path argument, ...)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            print(f"error: {' '.join(e.format_message().split())}", file=sys.stderr)
            return e.exit_code or 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
