"""`deltamoe bench [NAMES...] [--list] [--quick] [--table/--no-table] [--table-only [--check]]`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from deltamoe.benchmarks.suites import bench_dir, discover, run_suite, select
from deltamoe.benchmarks.table import render_table, split_readme, update_readme
from deltamoe.errors import ConfigError


def bench_command(
    names: list[str] | None = typer.Argument(None, help="suites to run (kda, serve_offline, ...); default: all"),
    list_suites: bool = typer.Option(False, "--list", help="list the suites and exit"),
    quick: bool = typer.Option(False, "--quick", help="smoke runs: small sizes, results in bench/results/*_quick.json"),
    table: bool = typer.Option(True, "--table/--no-table", help="regenerate the README table after a full run"),
    table_only: bool = typer.Option(False, "--table-only", help="regenerate the README table from the results, run nothing"),
    check: bool = typer.Option(False, "--check", help="run nothing, write nothing: exit 1 if the README table is stale"),
    results_dir: Path | None = typer.Option(None, "--results-dir", help="write results here instead of bench/results"),
    bench_folder: Path | None = typer.Option(None, "--bench-dir", help="the suites' folder (default: bench/ in the "
                                             "working directory, i.e. run at the root of a source checkout)"),
) -> None:
    """Run the benchmark suites side by side with their peers; the README table is generated from the results."""
    folder = bench_dir(bench_folder)
    console = Console()
    suites = select(discover(folder), names or [])  # an unknown name fails whatever the mode
    if list_suites:
        listing = Table(title=f"benchmark suites in {folder}")
        for column in ("name", "--quick", "what it measures"):
            listing.add_column(column)
        for suite in discover(folder):
            listing.add_row(suite.name, "yes" if suite.has_quick else "-", suite.summary)
        console.print(listing)
        return
    if table_only or check:
        _table(folder, check)
        return

    runs = []
    for i, suite in enumerate(suites, 1):
        console.rule(f"[{i}/{len(suites)}] {suite.name}" + (" --quick" if quick and suite.has_quick else ""))
        runs.append(run_suite(suite, quick, results_dir))
    summary = Table(title="benchmark runs")
    for column in ("suite", "status", "seconds"):
        summary.add_column(column)
    for run in runs:
        summary.add_row(run.suite.name, "ok" if run.ok else f"[red]failed (exit {run.returncode})[/red]", f"{run.seconds:.1f}")
    console.print(summary)
    if table and not quick and results_dir is None and any(run.ok for run in runs):
        _table(folder, check=False)
    failed = [run.suite.name for run in runs if not run.ok]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}[/red]")
        raise SystemExit(1)  # not typer.Exit: the app runs with standalone_mode=False, which swallows its code


def _table(folder: Path, check: bool) -> None:
    readme = folder.parent / "README.md"
    if not readme.exists():
        raise ConfigError(f"no README.md next to {folder}", field="README")
    table = render_table(folder / "results")
    if check:
        _, block, _ = split_readme(readme.read_text(), readme)
        if block != table:
            typer.echo(f"{readme}: the benchmark table is stale; run `deltamoe bench --table-only`", err=True)
            raise SystemExit(1)
        typer.echo(f"{readme}: the benchmark table matches {folder / 'results'}")
        return
    changed = update_readme(readme, table)
    typer.echo(f"{readme}: benchmark table {'regenerated' if changed else 'already up to date'}")
