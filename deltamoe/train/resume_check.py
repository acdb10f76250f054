"""What a resumed run may change relative to the configuration its checkpoint was trained with.

Resuming continues one run: the model, the data stream, the optimizer, the balance terms, the
seed and the precision must stay as they were, or the result is a different run that claims to
be the same one. Safe to change: where and how often to log, evaluate, save and profile (FP8
error statistics included), the stopping rules, threads and the parallel layout (DCP reshards on
load), `run.steps` as long as it does not fall below the checkpoint's step (the schedule is a
function of the step and the total, so the cosine is recomputed over the new total: the LR at the
resume point moves, which the notice says), and the peak learning rate and gradient clipping: the
recovery from a non-finite step (`Trainer._check_finite`) is to resume its last good checkpoint with
a lower `--lr` or a `--clip-grad`. Every accepted change is printed and recorded in resumes.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from deltamoe.errors import ConfigError
from deltamoe.train import checkpoint

RESUME_LOG = "resumes.jsonl"  # one line per resume that changed a (safe) setting

SAFE_FIELDS = frozenset({
    "run.out", "run.log_every", "run.eval_every", "run.save_every", "run.keep_checkpoints", "run.profile_steps",
    "run.resume", "run.resume_from", "run.target_accuracy", "run.max_minutes", "run.progress", "run.threads",
    "run.steps", "run.fp8_stats_every", "optim.lr", "optim.clip_grad",
})
SAFE_SECTIONS = frozenset({"parallel"})
# Fields that differ on almost every resume and need no notice.
QUIET_FIELDS = frozenset({"run.resume", "run.resume_from", "run.out", "run.progress", "run.threads"})


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """{"section.name": value} with JSON-normal values (tuples as lists), so saved and live configs compare."""
    plain = json.loads(json.dumps(config))
    return {f"{section}.{name}": value for section, fields in plain.items() if isinstance(fields, dict)
            for name, value in fields.items()}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved value, current value)} for every field that differs."""
    old, new = _flat(saved), _flat(current)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def refuse_unsafe(changes: dict[str, tuple[Any, Any]], safe: Callable[[str], bool], checkpoint: str,
                  keeps: str) -> None:
    """A ConfigError naming the first change `safe` does not allow (`keeps`: what a resume keeps);
    `deltamoe train`'s sections and `deltamoe rl`'s flat config share it."""
    unsafe = [k for k in changes if not safe(k)]
    if unsafe:
        old, new = changes[unsafe[0]]
        more = f" (and {len(unsafe) - 1} more: {', '.join(unsafe[1:])})" if len(unsafe) > 1 else ""
        raise ConfigError(f"{checkpoint} was trained with {unsafe[0]}={old!r}, this run asks for {new!r}{more}; "
                          f"a resumed run keeps {keeps}",
                          field=unsafe[0], hint="pass the original values, or start a new run in another --out")


def check_resume(saved: dict[str, Any], current: dict[str, Any], checkpoint_step: int,
                 checkpoint: str) -> dict[str, tuple[Any, Any]]:
    """The safe changes worth a notice; a ConfigError naming the first unsafe one otherwise."""
    changes = config_changes(saved, current)
    refuse_unsafe(changes, lambda k: k in SAFE_FIELDS or k.split(".")[0] in SAFE_SECTIONS, checkpoint,
                  "its model, data, optimizer (but for its peak lr and clipping), balance, seed and precision")
    steps = current.get("run", {}).get("steps")
    if isinstance(steps, int) and steps < checkpoint_step:
        raise ConfigError(f"{checkpoint} is at step {checkpoint_step}, beyond run.steps={steps}", field="run.steps",
                          hint=f"pass --steps {checkpoint_step} or more")
    return {k: v for k, v in changes.items() if k not in QUIET_FIELDS}


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    text = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    if "run.steps" in changes:
        text += " (the learning-rate schedule is recomputed over the new run.steps: the LR from here on follows it)"
    return text


def check_resume_config(path: Path, current: dict[str, Any], out: Path, logging_rank: bool) -> None:
    """Compare this run's config with the one saved in checkpoint `path` (already verified): refuse an
    unsafe change; print and record (in `out`/resumes.jsonl) the safe ones. The original run's
    train_config.json is left as it is."""
    saved = checkpoint.read_saved_config(path)
    if saved is None:
        return
    step = checkpoint.read_train_state(Path(path) / "train_state.rank0.json")[0].step
    changes = check_resume(saved, current, step, str(path))
    if changes and logging_rank:
        Console(stderr=True, soft_wrap=True).print(f"resuming {path} with changes: {describe(changes)}",
                                                   highlight=False)
        with open(Path(out) / RESUME_LOG, "a") as f:
            f.write(json.dumps({"step": step, "checkpoint": str(path), "changes": changes}) + "\n")
