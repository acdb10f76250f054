"""`deltamoe train`: a TOML/YAML/JSON run file and/or flags (flags win), then the training loop.

Works the same under torchrun (`torchrun --nproc-per-node 2 -m deltamoe train ...`): every rank
parses the same flags; only the logging rank prints and writes logs. `--dp` defaults to
WORLD_SIZE / (tp * pp).

Each flag is declared once, in `FLAGS`: the option, the TrainConfig field it sets and its help;
the option's type comes from that field. This module imports no torch: `--help` and bad input
(ConfigError: one line, exit 2) answer before the training stack is loaded.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional

import typer

from deltamoe.errors import ConfigError
from deltamoe.threads import THREADS_HELP
from deltamoe.train.config import TrainConfig, resolve_config


@dataclass(frozen=True)
class Flag:
    decls: tuple[str, ...]  # click declarations: ("--lr",), ("--out", "-o"), ("--ac/--no-ac",)
    field: str  # the TrainConfig field it sets, "section.name"
    help: str | None = None


FLAGS: tuple[Flag, ...] = (
    Flag(("--preset",), "model.preset", "model preset (tiny, small, ...)"),
    Flag(("--model",), "model.path", "model config.json or checkpoint folder to start from"),
    Flag(("--task",), "data.task", "synthetic task: recall|arithmetic|copy|reverse|repeat, or a mixture: recall+arithmetic"),
    Flag(("--data",), "data.path", ".txt or .jsonl ({'text': ...}) file instead of a task"),
    Flag(("--steps",), "run.steps", "optimizer steps"),
    Flag(("--seed",), "run.seed"),
    Flag(("--batch-size",), "data.batch_size", "global rows per optimizer step"),
    Flag(("--seq-len",), "data.seq_len"),
    Flag(("--grad-accum",), "optim.grad_accum", "micro-steps per optimizer step"),
    Flag(("--lr",), "optim.lr", "peak learning rate"),
    Flag(("--warmup",), "optim.warmup_steps", "linear warmup steps"),
    Flag(("--clip-grad",), "optim.clip_grad", "max gradient norm (<= 0: off)"),
    Flag(("--precision",), "run.precision", "fp32|bf16 (autocast)"),
    Flag(("--fp8",), "run.fp8", "blockwise: linears and experts in DeepSeek-V3 blockwise FP8 (forward and backward)"),
    Flag(("--fp8-stats-every",), "run.fp8_stats_every", "log fp8 quantisation error on step 1, every N-th and the last"),
    Flag(("--num-pairs",), "data.num_pairs", "recall: key/value pairs"),
    Flag(("--context-len",), "data.context_len", "recall: context tokens incl. filler"),
    Flag(("--bias-gamma",), "balance.gamma", "router bias update speed (0: off)"),
    Flag(("--balance-alpha",), "balance.alpha", "sequence balance loss weight"),
    Flag(("--out", "-o"), "run.out", "run folder"),
    Flag(("--target-accuracy",), "run.target_accuracy", "stop once held-out accuracy reaches it"),
    Flag(("--max-minutes",), "run.max_minutes", "stop after this much wall time"),
    Flag(("--eval-every",), "run.eval_every", "steps between evaluations (0: end only)"),
    Flag(("--save-every",), "run.save_every", "steps between checkpoints (0: end only)"),
    Flag(("--keep-checkpoints",), "run.keep_checkpoints", "checkpoints kept"),
    Flag(("--resume/--no-resume",), "run.resume", "continue from the newest checkpoint in --out"),
    Flag(("--resume-from",), "run.resume_from", "continue from this checkpoint folder"),
    Flag(("--profile-steps",), "run.profile_steps", "A:B profiles steps A..B-1 into traces/"),
    Flag(("--dp",), "parallel.dp", "data-parallel ranks (FSDP2); default: WORLD_SIZE / (tp * pp)"),
    Flag(("--tp",), "parallel.tp", "tensor-parallel ranks"),
    Flag(("--ep",), "parallel.ep", "expert-parallel ranks, carved out of dp"),
    Flag(("--pp",), "parallel.pp", "pipeline ranks"),
    Flag(("--ep-chunks",), "parallel.ep_chunks", "token chunks in flight through the EP all-to-all (> 1: overlap "
                                                  "it with expert compute)"),
    Flag(("--schedule",), "parallel.schedule", "pipeline schedule: 1f1b|interleaved1f1b"),
    Flag(("--microbatches",), "parallel.microbatches",
         "pipeline microbatches (accumulation across data ranks without pp; 1 on one process: use --grad-accum)"),
    Flag(("--ac/--no-ac",), "parallel.activation_checkpointing", "activation checkpointing"),
    Flag(("--offload-activations",), "parallel.offload_activations",
         "saved activations to host memory: 'layer' (with --ac: the checkpoint inputs), or 'attn', 'mlp', 'attn,mlp'"),
    Flag(("--threads",), "run.threads", THREADS_HELP + ", shared among torchrun's local ranks"),
    Flag(("--progress/--no-progress",), "run.progress"),
)


def field_type(dotted: str) -> type:
    """The Python type of a TrainConfig field, without its `| None`."""
    section, name = dotted.split(".")
    section_type = typing.get_type_hints(TrainConfig)[section]
    hint = typing.get_type_hints(section_type)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def _param_name(flag: Flag) -> str:
    return flag.field.replace(".", "__")


def train_command(**options: Any) -> None:
    """Train a model on a synthetic task or a text corpus; writes metrics, evals, checkpoints, plots."""
    config = options.pop("config")
    values = {flag.field: options[_param_name(flag)] for flag in FLAGS}
    if values["model.preset"] is not None and values["model.path"] is not None:
        raise ConfigError("pass either --preset or --model, not both", field="model")
    if values["data.task"] is not None and values["data.path"] is not None:
        raise ConfigError("pass either --task or --data, not both", field="data")
    overrides = {k: v for k, v in values.items() if v is not None}
    # A preset or task flag beats a checkpoint or data file named in the run file.
    if values["model.preset"] is not None:
        overrides["model.path"] = None
    if values["data.task"] is not None:
        overrides["data.path"] = None
    cfg = resolve_config(config, overrides)  # ConfigError here costs no torch import
    from deltamoe.cli import sigterm_as_ctrl_c
    from deltamoe.train.trainer import train

    # A scheduler, `timeout` or torchrun's agent (which passes Ctrl-C on as SIGTERM) stops the run as
    # Ctrl-C does: the interrupted-run message names the checkpoint to resume from.
    sigterm_as_ctrl_c()
    train(cfg)


def _signature() -> inspect.Signature:
    """One keyword option per FLAGS entry (plus --config): typer reads the command's options from it."""
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                                default=typer.Option(None, "--config", "-c", help="run file (.toml/.yaml/.json) with "
                                                     "model, data, optim, balance, parallel and run tables"))]
    for flag in FLAGS:
        params.append(inspect.Parameter(_param_name(flag), inspect.Parameter.KEYWORD_ONLY,
                                        annotation=Optional[field_type(flag.field)],
                                        default=typer.Option(None, *flag.decls, help=flag.help)))
    return inspect.Signature(params)


train_command.__signature__ = _signature()  # type: ignore[attr-defined]
