"""`deltamoe demo`: train -> serve -> plan -> trace in one run folder, in about five minutes on a CPU.

Stages run in order and each adds its section to results.json as soon as it is done. A folder
that already holds a finished checkpoint skips training (`--fresh` starts over); a run stopped
by Ctrl-C exits with code 130 and leaves only complete files, so the next run resumes training
from its last DCP checkpoint or reuses the finished one.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from deltamoe.demo.run_folder import RunFolder

DEFAULT_STEPS = 200
DEFAULT_MINUTES = 2.5


def demo_command(
    out: str = typer.Option("runs/demo", "--out", "-o", help="run folder (reused by the next run)"),
    fresh: bool = typer.Option(False, "--fresh", help="retrain even when the folder holds a finished checkpoint"),
    steps: int = typer.Option(DEFAULT_STEPS, "--steps", min=1, help="training steps (the LR schedule spans them)"),
    minutes: float = typer.Option(DEFAULT_MINUTES, "--minutes", min=0.01,
                                  help="stop training after this much wall time (checkpointed, then served)"),
    profile: bool = typer.Option(True, "--profile/--no-profile",
                                 help="record two training steps with the profiler and summarise the trace"),
    prompts: int = typer.Option(64, "--prompts", min=1, help="held-out prompts per task for the served model"),
    threads: int = typer.Option(1, "--threads", min=1,
                                help="torch threads: 2 is ~1.4x faster on an idle two-core machine, but many times "
                                     "slower on a busy one (threads spin waiting for each other)"),
    eval_rows: Optional[int] = typer.Option(None, "--eval-rows", min=1, hidden=True,
                                            help="held-out rows per training evaluation (tests)"),
) -> None:
    """Train tiny K3.1 on recall + arithmetic, serve it on held-out prompts, plan K3.1 Pro, summarise a trace."""
    from deltamoe.demo.run_folder import RunFolder  # imports torch: here, so `deltamoe --help` stays fast

    console = Console()
    folder = RunFolder(out)
    try:
        _run(folder, console, fresh, steps, minutes, profile, prompts, threads, eval_rows)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: every file in {folder.root} is complete "
                      f"({_saved_state(folder) or 'no training checkpoint yet'}); run the same command again to go on")
        # SystemExit, not typer.Exit: the app runs with standalone_mode=False, which swallows its code.
        raise SystemExit(130) from None


def _run(folder: RunFolder, console: Console, fresh: bool, steps: int, minutes: float, profile: bool,
         prompts: int, threads: int, eval_rows: int | None) -> None:
    import torch

    from deltamoe.demo.plan_stage import run_plans
    from deltamoe.demo.serve_stage import run_serve_eval
    from deltamoe.demo.trace_stage import run_trace_summary
    from deltamoe.demo.train_stage import TrainPlan, demo_tasks, run_training

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    folder.create()
    if fresh:
        folder.clear()
    results: dict[str, Any] = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               "folder": str(folder.root)}

    console.rule("[bold]1 · train")
    if folder.has_checkpoint():
        results["train"] = {**folder.read_results().get("train", {}), "reused": True}
        console.print(f"found the finished checkpoint {folder.checkpoint}: skipping training (--fresh retrains)")
    else:
        saved = _saved_state(folder)
        if saved:
            console.print(f"resuming the interrupted training from its {saved}")
        plan = TrainPlan(steps=steps, max_minutes=minutes, profile=profile, threads=threads, eval_rows=eval_rows)
        results["train"] = run_training(folder, plan, console)
    folder.save_results(results)

    console.rule("[bold]2 · serve")
    results["serve"] = run_serve_eval(folder.checkpoint, demo_tasks(), prompts, console)
    folder.save_results(results)

    console.rule("[bold]3 · plan")
    results["plans"] = run_plans(folder, console)
    folder.save_results(results)

    if profile and folder.has_traces():  # a reused checkpoint keeps the trace of its training
        console.rule("[bold]4 · trace")
        results["trace"] = run_trace_summary(folder, console)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    folder.save_results(results)
    _closing(console, folder, results)


def _saved_state(folder: RunFolder) -> str | None:
    """What a rerun would continue from, in words (None: nothing yet)."""
    if folder.has_checkpoint():
        return f"finished checkpoint in {folder.checkpoint}"
    from deltamoe.train.checkpoint import latest_checkpoint

    last = latest_checkpoint(folder.train)
    return f"training checkpoint {last.name} in {last.parent}" if last else None


def _closing(console: Console, folder: RunFolder, r: dict[str, Any]) -> None:
    console.rule("[bold]done")
    t, s = r["train"], r["serve"]
    if t.get("reused"):
        trained = "reused the checkpoint" + (f" of {t['steps']} steps" if "steps" in t else "")
    else:
        trained = f"trained {t['steps']} steps in {t['wall_s']:.0f} s" + (" (time limit)" * t["stopped_by_time"])
    console.print(f"{trained}; served {s['prompts']} held-out prompts: accuracy [bold]{s['accuracy']:.1%}[/], "
                  f"{s['tokens_per_s']:,.0f} tok/s; total {r['wall_s']:.0f} s")
    console.print(f"everything is in {folder.root}/: checkpoint/ (load_model / deltamoe generate), results.json, "
                  f"plans/, train/ (metrics, curves.png" + (", traces/)" if "trace" in r else ")")
                  + (", trace-report.json" if "trace" in r else ""))
