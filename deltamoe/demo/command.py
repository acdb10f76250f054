"""`deltamoe demo`: train -> serve -> plan -> trace in one run folder, in about three minutes on a CPU.

Training is a fixed number of steps, so the result is the same on an idle or a busy machine (only
the time differs); it starts with an estimate of that time, measured on a few steps. Stages run in
order and each adds its section to results.json as soon as it is done. A folder
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
    from deltamoe.demo.train_estimate import TrainEstimate
    from deltamoe.demo.train_stage import TrainPlan

DEFAULT_STEPS = 200  # sized for two to three minutes of training on an idle two-core machine (docs/demo.md)


def demo_command(
    out: str = typer.Option("runs/demo", "--out", "-o", help="run folder (reused by the next run)"),
    fresh: bool = typer.Option(False, "--fresh", help="retrain even when the folder holds a finished checkpoint"),
    steps: int = typer.Option(DEFAULT_STEPS, "--steps", min=1, help="training steps (the LR schedule spans them)"),
    seed: int = typer.Option(0, "--seed", min=0, help="training seed: initial weights and data order"),
    minutes: Optional[float] = typer.Option(None, "--minutes", min=0.01,
                                            help="optional cap: stop training after this much wall time "
                                                 "(checkpointed, then served); the result then depends on the "
                                                 "machine's load"),
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
    from deltamoe.output_paths import check_output_folder

    check_output_folder(out, "--out")  # a file, /proc or an unwritable folder: one line before any work
    from deltamoe.demo.run_folder import RunFolder  # imports torch: here, so `deltamoe --help` stays fast
    from deltamoe.demo.train_stage import TrainPlan

    console = Console()
    folder = RunFolder(out)
    try:
        plan = TrainPlan(steps=steps, max_minutes=minutes, profile=profile, seed=seed, threads=threads,
                         eval_rows=eval_rows)
        _run(folder, console, fresh, plan, prompts)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: every file in {folder.root} is complete "
                      f"({_saved_state(folder) or 'no training checkpoint yet'}); run the same command again to go on")
        # SystemExit, not typer.Exit: the app runs with standalone_mode=False, which swallows its code.
        raise SystemExit(130) from None


def _run(folder: RunFolder, console: Console, fresh: bool, plan: TrainPlan, prompts: int) -> None:
    import torch

    from deltamoe.demo.plan_stage import run_plans
    from deltamoe.demo.serve_stage import run_serve_eval
    from deltamoe.demo.trace_stage import run_trace_summary
    from deltamoe.demo.train_stage import demo_tasks, run_training

    torch.set_num_threads(plan.threads)
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
        estimate = _estimate(folder, plan, console, resuming=saved is not None)
        results["train"] = run_training(folder, plan, console)
        if estimate is not None:
            results["train"]["estimated_s"] = round(estimate.total_s, 1)
    folder.save_results(results)

    console.rule("[bold]2 · serve")
    results["serve"] = run_serve_eval(folder.checkpoint, demo_tasks(), prompts, console)
    folder.save_results(results)

    console.rule("[bold]3 · plan")
    results["plans"] = run_plans(folder, console)
    folder.save_results(results)

    if plan.profile and folder.has_traces():  # a reused checkpoint keeps the trace of its training
        console.rule("[bold]4 · trace")
        results["trace"] = run_trace_summary(folder, console)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    folder.save_results(results)
    _closing(console, folder, results)


def _estimate(folder: RunFolder, plan: TrainPlan, console: Console, resuming: bool) -> TrainEstimate | None:
    """Time a few steps and print how long the training will take; None for runs too short to need it."""
    from deltamoe.demo.train_estimate import MIN_STEPS, PROBE_STEPS, estimate_training
    from deltamoe.demo.train_stage import train_config

    if plan.steps < MIN_STEPS:
        return None
    console.print(f"timing {PROBE_STEPS} steps to estimate the training time ...")
    estimate = estimate_training(train_config(folder, plan))
    resumed = "; this run resumes part way, so less" if resuming else ""
    console.print(f"training: {estimate.describe()}{resumed}")
    return estimate


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
        trained += f" (estimated {t['estimated_s']:.0f} s)" if "estimated_s" in t else ""
    console.print(f"{trained}; served {s['prompts']} held-out prompts: accuracy [bold]{s['accuracy']:.1%}[/], "
                  f"{s['tokens_per_s']:,.0f} tok/s; total {r['wall_s']:.0f} s")
    console.print(f"everything is in {folder.root}/: checkpoint/ (load_model / deltamoe generate), results.json, "
                  f"plans/, train/ (metrics, curves.png" + (", traces/)" if "trace" in r else ")")
                  + (", trace-report.json" if "trace" in r else ""))
