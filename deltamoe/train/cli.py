"""`deltamoe train`: a TOML/YAML/JSON run file and/or flags (flags win), then the training loop.

Works the same under torchrun (`torchrun --nproc-per-node 2 -m deltamoe train --dp 2 ...`):
every rank parses the same flags; only the logging rank prints and writes logs.
"""

from __future__ import annotations

from typing import Optional

import typer

from deltamoe.errors import ConfigError


def train_command(
    config: Optional[str] = typer.Option(None, "--config", "-c", help="run file (.toml/.yaml/.json) with "
                                         "model, data, optim, balance, parallel and run tables"),
    preset: Optional[str] = typer.Option(None, "--preset", help="model preset (tiny, small, ...)"),
    model: Optional[str] = typer.Option(None, "--model", help="model config.json or checkpoint folder to start from"),
    task: Optional[str] = typer.Option(None, "--task", help="synthetic task: recall|arithmetic|copy|reverse, or a mixture: recall+arithmetic"),
    data: Optional[str] = typer.Option(None, "--data", help=".txt or .jsonl ({'text': ...}) file instead of a task"),
    steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="global rows per optimizer step"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="micro-steps per optimizer step"),
    lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate"),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="linear warmup steps"),
    clip_grad: Optional[float] = typer.Option(None, "--clip-grad", help="max gradient norm (<= 0: off)"),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32|bf16 (autocast)"),
    num_pairs: Optional[int] = typer.Option(None, "--num-pairs", help="recall: key/value pairs"),
    context_len: Optional[int] = typer.Option(None, "--context-len", help="recall: context tokens incl. filler"),
    gamma: Optional[float] = typer.Option(None, "--bias-gamma", help="router bias update speed (0: off)"),
    alpha: Optional[float] = typer.Option(None, "--balance-alpha", help="sequence balance loss weight"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="run folder"),
    target_accuracy: Optional[float] = typer.Option(None, "--target-accuracy",
                                                    help="stop once held-out accuracy reaches it"),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="stop after this much wall time"),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="steps between evaluations (0: end only)"),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="steps between checkpoints (0: end only)"),
    keep: Optional[int] = typer.Option(None, "--keep-checkpoints", help="checkpoints kept"),
    resume: Optional[bool] = typer.Option(None, "--resume/--no-resume",
                                          help="continue from the newest checkpoint in --out"),
    resume_from: Optional[str] = typer.Option(None, "--resume-from", help="continue from this checkpoint folder"),
    profile_steps: Optional[str] = typer.Option(None, "--profile-steps", help="A:B profiles steps A..B-1 into traces/"),
    dp: Optional[int] = typer.Option(None, "--dp"),
    tp: Optional[int] = typer.Option(None, "--tp"),
    ep: Optional[int] = typer.Option(None, "--ep"),
    pp: Optional[int] = typer.Option(None, "--pp"),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="pipeline schedule: 1f1b|interleaved1f1b"),
    microbatches: Optional[int] = typer.Option(None, "--microbatches", help="pipeline microbatches"),
    activation_checkpointing: Optional[bool] = typer.Option(None, "--ac/--no-ac", help="activation checkpointing"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per process"),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress"),
) -> None:
    """Train a model on a synthetic task or a text corpus; writes metrics, evals, checkpoints, plots."""
    from deltamoe.train.config import resolve_config
    from deltamoe.train.trainer import train

    if preset is not None and model is not None:
        raise ConfigError("pass either --preset or --model, not both", field="model")
    if task is not None and data is not None:
        raise ConfigError("pass either --task or --data, not both", field="data")
    flags = {
        "model.preset": preset, "model.path": model, "data.task": task, "data.path": data,
        "run.steps": steps, "run.seed": seed, "data.batch_size": batch_size, "data.seq_len": seq_len,
        "optim.grad_accum": grad_accum, "optim.lr": lr, "optim.warmup_steps": warmup, "optim.clip_grad": clip_grad,
        "run.precision": precision, "data.num_pairs": num_pairs, "data.context_len": context_len,
        "balance.gamma": gamma, "balance.alpha": alpha, "run.out": out, "run.eval_every": eval_every,
        "run.target_accuracy": target_accuracy, "run.max_minutes": max_minutes,
        "run.save_every": save_every, "run.keep_checkpoints": keep, "run.resume": resume,
        "run.resume_from": resume_from, "run.profile_steps": profile_steps, "parallel.dp": dp, "parallel.tp": tp,
        "parallel.ep": ep, "parallel.pp": pp, "parallel.schedule": schedule, "parallel.microbatches": microbatches,
        "parallel.activation_checkpointing": activation_checkpointing, "run.threads": threads,
        "run.progress": progress,
    }
    overrides = {k: v for k, v in flags.items() if v is not None}
    # A preset or task flag beats a checkpoint or data file named in the run file.
    if preset is not None:
        overrides["model.path"] = None
    if task is not None:
        overrides["data.path"] = None
    train(resolve_config(config, overrides))
