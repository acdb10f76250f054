"""Placeholder: the training engineer replaces this with the real `deltamoe train` command."""

import typer


def train_command() -> None:
    """Train a model (not built yet)."""
    raise typer.Exit(1)
