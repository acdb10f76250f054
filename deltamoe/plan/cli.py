"""Placeholder: the planner helper replaces this file with the real `deltamoe plan` command."""

import typer


def plan_command() -> None:
    """Deployment planner (not built yet)."""
    raise typer.Exit(1)
