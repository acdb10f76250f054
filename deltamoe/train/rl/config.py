"""RLConfig: one dataclass for `deltamoe rl`'s settings, checked before torch loads (plain Python)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from deltamoe.errors import ConfigError

# What a resume may change (`RLConfig.check_resume`).
RESUME_SAFE = frozenset({"out", "resume", "steps", "eval_every", "eval_prompts", "save_every", "keep_checkpoints",
                         "threads", "progress", "plot", "rollout_retries", "rollout_timeout_s", "micro_rows", "dp",
                         "bucket_bytes"})

TASKS = ("arithmetic", "recall")
COMPLETIONS = ("answer", "eos")
OPTIMIZERS = ("adamw", "sgd")
ADVANTAGE_NORMS = ("std", "mean")


@dataclass
class RLConfig:
    # the policy: a preset's seeded weights, or a checkpoint folder (a `deltamoe train` run's model/)
    preset: str | None = "tiny"
    init: str | None = None
    # the verifiable task (deltamoe/train/data/tasks.py)
    task: str = "arithmetic"
    digits: int = 2  # arithmetic operands of 1..digits digits
    num_pairs: int = 4  # recall key/value pairs
    # GRPO
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8  # completions per prompt; advantages are normalised within each group
    updates_per_batch: int = 2  # optimizer steps on each rollout batch (> 1: the clip matters)
    optimizer: str = "adamw"  # "sgd": plain SGD; with the clipped gradient, each step moves <= lr * max_grad_norm
    lr: float = 2e-5
    # Linear warmup over the first optimizer steps: a fresh AdamW's first steps are sign-like
    # (every parameter moves by ~lr), which at an RL-sized lr throws a supervised policy far off.
    warmup_steps: int = 0
    # A `deltamoe train` checkpoint (its checkpoints/step-N folder) whose AdamW step count and second
    # moments the RL optimizer starts from: the supervised run's per-parameter step sizes, so the
    # first RL steps are not sign-like (a fresh AdamW's are). The first moment starts at zero.
    init_optimizer: str | None = None
    advantage_norm: str = "std"  # "std": GRPO's (r - mean) / std; "mean": (r - mean) / mean (log expected reward)
    clip_eps: float = 0.2  # ratio clip [1 - eps, 1 + eps]
    kl_coef: float = 0.0  # > 0: k3 KL to the initial policy (a frozen copy) in the loss
    temperature: float = 1.0
    # Where a completion ends. "answer": after as many tokens as the expected answer has (the verifier
    # knows it), like the answer accuracy `deltamoe train` scores: a supervised checkpoint never
    # learned to emit EOS (its EOS labels are not scored). "eos": the model must stop by itself
    # (EOS) within the longest answer + 1 tokens, and an exact answer means the text before EOS.
    completion: str = "answer"
    format_reward: float = 0.0  # added when a completion is well-formed (task alphabet, properly ended)
    max_grad_norm: float = 1.0
    micro_rows: int = 256  # trainer rows per forward/backward; their gradients are summed (same update, less memory)
    # the trainer: data-parallel ranks (FSDP2) under torchrun; None: WORLD_SIZE (1 for a plain process)
    dp: int | None = None
    # rollouts
    rollout_retries: int = 1  # a failed rollout request is retried this often, then dropped (counted)
    rollout_timeout_s: float = 300.0  # a rollout batch still running after this is aborted (dropped)
    bucket_bytes: int = 512 * 2**20  # weight-sync bucket size (<= 0: one tensor at a time)
    # evaluation, logging, checkpoints
    eval_every: int = 5  # steps between held-out greedy evaluations (0: start and end only)
    eval_prompts: int = 64
    save_every: int = 10  # steps between checkpoints (0: end only)
    keep_checkpoints: int = 2
    out: str = "runs/rl"
    resume: bool = False  # continue from the newest checkpoint in `out`
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    plot: bool = True  # curves.png at the end (and when stopped)

    def validate(self) -> "RLConfig":
        """ConfigError naming the first bad field; returns self."""
        if (self.preset is None) == (self.init is None):
            raise ConfigError("pass exactly one of --preset or --init", field="init")
        if self.init is not None and not Path(self.init).is_dir():
            raise ConfigError(f"expected a checkpoint folder, got {self.init!r}", field="init",
                              hint="--preset NAME starts from a preset's random weights")
        if self.task not in TASKS:
            raise ConfigError(f"expected one of {', '.join(TASKS)}, got {self.task!r}", field="task")
        if self.advantage_norm not in ADVANTAGE_NORMS:
            raise ConfigError(f"expected one of {', '.join(ADVANTAGE_NORMS)}, got {self.advantage_norm!r}",
                              field="advantage_norm")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}", field="optimizer")
        if self.init_optimizer is not None and self.optimizer != "adamw":
            raise ConfigError("carries AdamW's state: needs --optimizer adamw", field="init_optimizer")
        if self.completion not in COMPLETIONS:
            raise ConfigError(f"expected one of {', '.join(COMPLETIONS)}, got {self.completion!r}", field="completion")
        positive = ("digits", "num_pairs", "steps", "prompts_per_step", "group_size", "updates_per_batch",
                    "eval_prompts", "keep_checkpoints", "micro_rows")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"expected a positive integer, got {value!r}", field=name)
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ConfigError(f"expected a positive integer, got {self.dp!r}", field="dp")
        if self.group_size < 2:
            raise ConfigError("a group needs at least 2 completions to compare", field="group_size")
        for name in ("eval_every", "save_every", "rollout_retries", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)!r}", field=name)
        # Finite where an inf would only turn the weights to NaN (the checks below let inf through).
        for name in ("lr", "kl_coef", "format_reward"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isinf(value):
                raise ConfigError(f"expected a finite number, got {value!r}", field=name)
        for name, ok, expected in [("lr", self.lr > 0, "> 0"), ("clip_eps", 0 < self.clip_eps < 1, "in (0, 1)"),
                                   ("kl_coef", self.kl_coef >= 0, ">= 0"),
                                   ("temperature", 0 < self.temperature <= 10, "in (0, 10]"),
                                   ("format_reward", self.format_reward >= 0, ">= 0"),
                                   ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
                                   ("rollout_timeout_s", self.rollout_timeout_s > 0, "> 0")]:
            if not ok:
                raise ConfigError(f"expected {expected}, got {getattr(self, name)!r}", field=name)
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def check_resume(self, saved: dict, checkpoint: str) -> None:
        """A resume continues one run: only where and how often it logs, evaluates and saves, its
        stopping point, threads, rollout retries / timeout, micro-rows and the data-parallel layout
        (RESUME_SAFE) may differ from the config its checkpoint saved; anything else is a ConfigError
        naming it (`train.resume_check.refuse_unsafe`)."""
        from deltamoe.train.resume_check import refuse_unsafe  # here: this module stays torch-free

        current = json.loads(json.dumps(self.to_dict()))

        def same(key: str) -> bool:
            old, new = saved.get(key), current.get(key)
            if key in ("init", "init_optimizer") and isinstance(old, str) and isinstance(new, str):
                return Path(old).resolve() == Path(new).resolve()  # one folder, written relative or absolute
            return old == new

        changes = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current)) if not same(k)}
        refuse_unsafe(changes, lambda k: k in RESUME_SAFE, checkpoint,
                      "its policy, task, GRPO and optimizer settings and seed")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
