"""Demo stage 1: train the `tiny` preset on a mixture of associative recall and arithmetic.

The ordinary trainer does the work (progress bar, held-out evaluation, DCP checkpoints every
few steps, a profiler window, the safetensors export); this file only chooses the recipe and
moves the finished export into the run folder's `checkpoint/`. An interrupted run leaves its
DCP checkpoints in `train/`, and the next run resumes from the newest one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from deltamoe.demo.run_folder import RunFolder
from deltamoe.train.config import TrainConfig
from deltamoe.train.data import build_data
from deltamoe.train.data.tasks import Task, make_task
from deltamoe.train.model_setup import resolve_model_config
from deltamoe.train.trainer import Trainer

PRESET = "tiny"
TASK = "recall+arithmetic"
# Recall as in bench/bench_train_quality.py (8 key/value pairs, all 8 queried; chance 10 % per
# answer) and sums of 1-2 digit numbers. 48-token rows hold one recall example and one or two
# sums; with 40-token rows (one task per row, half of them recall) recall stayed at chance for
# 200 steps. lr 1e-3 beat 2e-3, 3e-3 (the recall-only tuning) and 6e-3 at every evaluation up
# to step 150 (one run each), which matters when a --minutes cap ends a run early (see
# docs/demo.md for the held-out accuracies per learning rate).
RECIPE: dict[str, dict[str, Any]] = {
    "model": {"preset": PRESET},
    "data": {"num_pairs": 8, "num_queries": 8, "digits": 2, "seq_len": 48, "batch_size": 32, "eval_rows": 128},
    "optim": {"lr": 1e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
    "run": {"eval_every": 25, "save_every": 25, "keep_checkpoints": 1},
}
PROFILE_STEPS = "3:5"  # two steps (after one warmup step) recorded as train/traces/rank0.json


@dataclass(frozen=True)
class TrainPlan:
    steps: int
    max_minutes: float | None  # None: no time cap, the step count alone ends training
    profile: bool
    seed: int = 0
    threads: int | None = None
    eval_rows: int | None = None  # tests shrink the held-out evaluation


def demo_tasks() -> tuple[Task, ...]:
    """The mixture's tasks with the recipe's settings (what the serve stage draws prompts from)."""
    d = RECIPE["data"]
    mixture = make_task(TASK, digits=d["digits"], num_pairs=d["num_pairs"], num_queries=d["num_queries"])
    return mixture.tasks


def train_config(folder: RunFolder, plan: TrainPlan) -> TrainConfig:
    recipe = {k: dict(v) for k, v in RECIPE.items()}
    recipe["run"].update(out=str(folder.train), steps=plan.steps, max_minutes=plan.max_minutes, seed=plan.seed,
                         threads=plan.threads, resume=True,
                         profile_steps=PROFILE_STEPS if plan.profile and plan.steps >= 5 else None)
    recipe["optim"]["warmup_steps"] = min(recipe["optim"]["warmup_steps"], plan.steps // 5)
    if plan.eval_rows is not None:
        recipe["data"]["eval_rows"] = plan.eval_rows
    recipe["data"]["task"] = TASK
    return TrainConfig.from_dict(recipe).validate()


def run_training(folder: RunFolder, plan: TrainPlan, console: Console) -> dict[str, Any]:
    """Train (or resume an interrupted run), publish `checkpoint/`; the summary for results.json."""
    cfg = train_config(folder, plan)
    model_config = resolve_model_config(cfg.model)
    data = build_data(cfg, model_config)
    trainer = Trainer(cfg, model_config, data, mesh=None)
    console.print(f"training [bold]{cfg.model.preset}[/] ({model_config.model_type}: KDA + DSA + latent MoE + AttnRes "
                  f"+ MTP) on {TASK}: {cfg.run.steps} steps of {cfg.data.batch_size} x {cfg.data.seq_len} tokens"
                  + (f", at most {cfg.run.max_minutes:g} min" if cfg.run.max_minutes else "") + f" -> {folder.train}")
    t0 = time.perf_counter()
    result = trainer.run()
    wall = time.perf_counter() - t0
    folder.publish_checkpoint(folder.train / "model")
    params = sum(p.numel() for p in trainer.parts[0].parameters())
    return {
        "preset": cfg.model.preset, "task": TASK, "parameters": params, "steps": result.step,
        "planned_steps": cfg.run.steps,        "stopped_by_time": result.step < cfg.run.steps, "wall_s": round(wall, 1),
        "tokens": result.step * cfg.data.batch_size * cfg.data.seq_len,
        "resumed_from_step": result.metrics[0]["step"] - 1 if result.metrics else result.step,
        "final_eval": result.final_eval, "settings": {k: cfg.to_dict()[k] for k in ("data", "optim")},
        "checkpoint": str(folder.checkpoint), "reused": False,
    }
