"""Placeholder: the trace helper replaces this file with the real `deltamoe trace` sub-app."""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def analyze() -> None:
    """Trace analyzer (not built yet)."""
    raise typer.Exit(1)
