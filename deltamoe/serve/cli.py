"""Placeholder: the serving engineers replace this with `deltamoe serve|generate|chat`."""

import typer


def serve_command() -> None:
    """OpenAI-compatible server (not built yet)."""
    raise typer.Exit(1)


def generate_command() -> None:
    """Offline generation (not built yet)."""
    raise typer.Exit(1)


def chat_command() -> None:
    """Interactive chat (not built yet)."""
    raise typer.Exit(1)
