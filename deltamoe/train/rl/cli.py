"""`deltamoe rl`: GRPO post-training with the serving engine as the rollout worker (one process).

Each option sets the RLConfig field of the same name; the config is checked (ConfigError: one
line, exit 2) before torch loads. Ctrl-C stops after saving a checkpoint; `--resume` continues it.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Optional

import typer

from deltamoe.threads import THREADS_HELP
from deltamoe.train.rl.config import RLConfig

HELP = {
    "preset": "model preset to start from (seeded random weights; see --init)",
    "init": "checkpoint folder to start from (e.g. a `deltamoe train` run's model/)",
    "task": "verifiable task: arithmetic|recall",
    "digits": "arithmetic: operands of 1..digits digits",
    "num_pairs": "recall: key/value pairs",
    "steps": "GRPO steps (rollout -> update -> weight sync)",
    "prompts_per_step": "prompts sampled per step",
    "group_size": "completions per prompt (G)",
    "updates_per_batch": "optimizer steps per rollout batch",
    "optimizer": "adamw|sgd (plain SGD: with the clipped gradient each step moves at most lr * max-grad-norm)",
    "lr": "learning rate (constant after the warmup)",
    "warmup_steps": "optimizer steps of linear lr warmup (a fresh AdamW's first steps are sign-like)",
    "init_optimizer": "a `deltamoe train` checkpoint folder (checkpoints/step-N) whose AdamW step count and "
                      "second moments the RL optimizer starts from (the one --init's model/ was exported with)",
    "advantage_norm": "std: GRPO's (r - mean) / std; mean: (r - mean) / mean, the gradient of log expected reward",
    "clip_eps": "PPO ratio clip epsilon",
    "kl_coef": "weight of the KL to the initial policy (0: logged only)",
    "temperature": "rollout sampling temperature",
    "completion": "answer: cut at the answer's length (a supervised checkpoint never learned EOS); "
                  "eos: the model must stop by itself",
    "format_reward": "reward added for a well-formed answer (task alphabet, properly ended)",
    "max_grad_norm": "gradient clipping norm",
    "micro_rows": "trainer rows per forward/backward (gradients summed over them: the same update, less memory)",
    "dp": "trainer data-parallel ranks (FSDP2) under torchrun; rank 0 owns the engine; default: WORLD_SIZE",
    "rollout_retries": "retries of a failed rollout request before it is dropped",
    "rollout_timeout_s": "a rollout batch still running after this many seconds is aborted",
    "bucket_bytes": "weight-sync bucket size in bytes (<= 0: one tensor per bucket)",
    "eval_every": "steps between held-out greedy evaluations (0: start and end only)",
    "eval_prompts": "held-out prompts per evaluation",
    "save_every": "steps between checkpoints (0: end only)",
    "keep_checkpoints": "checkpoints kept",
    "out": "run folder (metrics.jsonl, curves.png, checkpoints/, model/)",
    "resume": "continue from the newest checkpoint in --out",
    "seed": None,
    "threads": THREADS_HELP,
    "progress": None,
    "plot": "write curves.png at the end",
}


def rl_command(**options: Any) -> None:
    """GRPO on a verifiable task: the engine samples, the trainer updates, weights sync live."""
    values = {k: v for k, v in options.items() if v is not None}
    if "init" in values and "preset" not in values:
        values["preset"] = None
    cfg = RLConfig(**values).validate()  # ConfigError here costs no torch import
    from deltamoe.train.rl.loop import run_rl

    result = run_rl(cfg)
    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 speaks for the run
        raise typer.Exit(130 if result.interrupted else 0)
    last = next((r for r in reversed(result.records) if r.get("eval_accuracy") is not None), None)
    summary = f"step {result.step}" + (f": held-out accuracy {last['eval_accuracy']:.1%}" if last else "")
    if result.interrupted:
        print(f"interrupted at {summary}; checkpoint saved, continue with --resume -> {result.out}", file=sys.stderr)
        raise typer.Exit(130)
    print(f"{summary} -> {result.out}", file=sys.stderr)


def _option(name: str, annotation: Any) -> inspect.Parameter:
    """`--name` typed like the RLConfig field (without its `| None`); booleans as --name/--no-name."""
    flag = "--" + name.replace("_", "-")
    optional = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    base = next(a for a in typing.get_args(annotation) if a is not type(None)) if optional else annotation
    decls = (f"{flag}/--no-{flag[2:]}",) if base is bool else (flag,)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[base],
                             default=typer.Option(None, *decls, help=HELP.get(name)))


def _signature() -> inspect.Signature:
    hints = typing.get_type_hints(RLConfig)
    return inspect.Signature([_option(f.name, hints[f.name]) for f in fields(RLConfig)
                              if f.default is not MISSING])


rl_command.__signature__ = _signature()  # type: ignore[attr-defined]
