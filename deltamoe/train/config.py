"""TrainConfig: every knob of a training run as plain dataclasses, one per concern.

A run is configured by a TOML/YAML/JSON file whose tables mirror the sections below
(`[optim] lr = 3e-3`), then by command-line flags, which override the file. Every value is
validated here, before any data is read or any process group exists, and a bad one raises
ConfigError naming the field as `section.name`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.parallel.dims import ParallelDims, launch_world_size

TASKS = ("recall", "arithmetic", "copy", "reverse", "repeat")
PRECISIONS = ("fp32", "bf16")
FP8_RECIPES = (None, "blockwise")


@dataclass
class ModelSection:
    preset: str | None = "tiny"  # a preset name (deltamoe/presets)
    path: str | None = None  # a config.json, or a checkpoint folder whose weights initialise the run
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields to replace (small test models)


@dataclass
class DataSection:
    task: str | None = "recall"  # a built-in synthetic task; ignored when `path` is set
    path: str | None = None  # a .txt or .jsonl file ({"text": ...} per line)
    # Defaults: 8-pair, 8-query recall, one example per 40-token row; the `tiny` preset learns
    # it to 95 % held-out accuracy in ~275 steps (bench/bench_train_quality.py).
    seq_len: int = 40
    batch_size: int = 32  # global rows per optimizer step (all data ranks, all accumulation steps)
    # recall: `num_pairs` key/value pairs spread over `context_len` tokens, `num_queries` queries after them
    num_pairs: int = 8
    context_len: int | None = None  # None: just the pairs, no filler
    num_queries: int = 8
    # arithmetic: operands of 1..`digits` digits; copy/reverse/repeat: strings of 1..`string_len` letters
    digits: int = 3
    string_len: int = 8
    eval_rows: int = 128  # held-out rows scored at each evaluation
    eval_fraction: float = 0.05  # text data: share of packed rows held out for evaluation


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1  # matrices only; norms, vectors and biases are not decayed
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # <= 0 disables clipping (the norm is still logged)
    grad_accum: int = 1  # micro-steps per optimizer step


@dataclass
class BalanceSection:
    gamma: float = 1e-3  # aux-loss-free router bias step (DeepSeek-V3); 0 disables
    alpha: float = 0.0  # sequence-level balance loss weight; 0 disables


@dataclass
class RunSection:
    out: str = "runs/train"
    steps: int = 200
    seed: int = 0
    precision: str = "fp32"  # "bf16" runs forward/backward under autocast; parameters stay fp32
    log_every: int = 1
    eval_every: int = 50  # 0: only at the end
    save_every: int = 0  # DCP checkpoint every N steps; 0: only at the end
    keep_checkpoints: int = 2
    profile_steps: str | None = None  # "A:B" profiles steps A..B-1 (1-based)
    resume: bool = False  # continue from the newest checkpoint in `out`
    resume_from: str | None = None  # or from this checkpoint folder
    target_accuracy: float | None = None  # stop once a held-out evaluation reaches it (time-to-quality)
    max_minutes: float | None = None  # stop (checkpoint, evaluate, export) once the run has taken this long
    progress: bool = True
    threads: int | None = None  # torch intra-op threads per process
    fp8: str | None = None  # "blockwise": linears and experts in DeepSeek-V3 blockwise FP8 (train/fp8.py)
    fp8_stats_every: int = 10  # fp8 quantisation error in metrics.jsonl: steps 1, every N-th and the last


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    balance: BalanceSection = field(default_factory=BalanceSection)
    parallel: ParallelDims = field(default_factory=ParallelDims)  # the layout itself, as parallelize takes it
    run: RunSection = field(default_factory=RunSection)

    # ------------------------------------------------------------- building
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        cfg = cls()
        cfg.update(data)
        return cfg

    def update(self, data: dict[str, Any]) -> None:
        """Merge nested `{section: {name: value}}` or dotted `{"section.name": value}` entries."""
        for key, value in data.items():
            if "." in key:
                section, name = key.split(".", 1)
                self._set(section, name, value)
            elif isinstance(value, dict) and key in _sections():
                for name, v in value.items():
                    self._set(key, name, v)
            elif key in _sections():
                raise ConfigError(f"expected a table of {key} fields, got {value!r}", field=key)
            else:
                raise ConfigError(f"unknown section {key!r}; expected one of {sorted(_sections())}", field=key)

    def _set(self, section: str, name: str, value: Any) -> None:
        if section not in _sections():
            raise ConfigError(f"unknown section {section!r}; expected one of {sorted(_sections())}", field=section)
        obj = getattr(self, section)
        names = {f.name for f in dataclasses.fields(obj)}
        if name not in names:
            raise ConfigError(f"unknown field; expected one of {sorted(names)}", field=f"{section}.{name}")
        setattr(obj, name, value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ----------------------------------------------------------- validation
    def validate(self, world_size: int | None = None) -> "TrainConfig":
        """Check every field; fill `parallel.dp` from the world size (default: torchrun's WORLD_SIZE) when
        it is not given. The layout is checked against the model later, once the model config is read."""

        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                section, attr = name.split(".")
                got = getattr(getattr(self, section), attr)
                raise ConfigError(f"expected {expected}, got {got!r}", field=name)

        def positive_int(name: str) -> None:
            section, attr = name.split(".")
            v = getattr(getattr(self, section), attr)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive integer")

        def number(name: str, lo: float, hi: float = float("inf"), lo_open: bool = False) -> None:
            section, attr = name.split(".")
            v = getattr(getattr(self, section), attr)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > lo if lo_open else v >= lo) and v <= hi)
            need(ok, name, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}{')' if math.isinf(hi) else ']'}")

        m, d, o, p, r = self.model, self.data, self.optim, self.parallel, self.run
        # Types a run file can get wrong that no later check would catch: a string flag is truthy
        # (resume = "no" resumed), a number where a path goes failed deep inside with a traceback.
        for name in ("model.preset", "model.path", "data.task", "data.path", "run.resume_from", "run.profile_steps",
                     "run.fp8"):
            section, attr = name.split(".")
            v = getattr(getattr(self, section), attr)
            need(v is None or (isinstance(v, str) and v != ""), name, "None or a non-empty string")
        need(isinstance(r.out, str), "run.out", "a folder path")  # an empty one: check_output_folder says so
        need(isinstance(r.precision, str), "run.precision", f"one of {PRECISIONS}")
        for name in ("run.resume", "run.progress"):
            need(isinstance(getattr(r, name.split(".")[1]), bool), name, "true or false")
        need(isinstance(r.seed, int) and not isinstance(r.seed, bool), "run.seed", "an integer")
        need(m.preset is not None or m.path is not None, "model.preset", "a preset name or model.path")
        need(isinstance(m.overrides, dict), "model.overrides", "a table of ModelConfig fields")
        parts = d.task.split("+") if isinstance(d.task, str) else [None]
        need(d.path is not None or all(t in TASKS for t in parts), "data.task",
             f"one of {TASKS} or a mixture like 'recall+arithmetic' (or set data.path)")
        for name in ("data.seq_len", "data.batch_size", "data.num_pairs", "data.num_queries", "data.digits",
                     "data.string_len", "data.eval_rows", "optim.grad_accum", "run.steps", "run.log_every", "run.keep_checkpoints"):
            positive_int(name)
        need(d.context_len is None or (isinstance(d.context_len, int) and d.context_len > 0), "data.context_len",
             "None or a positive integer")
        number("data.eval_fraction", 0.0, 0.5)
        number("optim.lr", 0.0, lo_open=True)
        number("optim.min_lr_ratio", 0.0, 1.0)
        need(isinstance(o.warmup_steps, int) and 0 <= o.warmup_steps, "optim.warmup_steps", "an integer >= 0")
        number("optim.weight_decay", 0.0)
        number("optim.beta1", 0.0, 1.0)
        number("optim.beta2", 0.0, 1.0)
        number("optim.eps", 0.0, lo_open=True)
        number("optim.clip_grad", float("-inf"))
        number("balance.gamma", 0.0)
        number("balance.alpha", 0.0)
        try:
            p.check_fields()
            self.parallel = p = p.with_world(launch_world_size() if world_size is None else world_size)
        except ConfigError as e:
            raise ConfigError(str(e), field=f"parallel.{e.field}", hint=e.hint) from None
        need(r.precision in PRECISIONS, "run.precision", f"one of {PRECISIONS}")
        need(r.fp8 in FP8_RECIPES, "run.fp8", f"one of {FP8_RECIPES}")
        need(r.fp8 is None or p.tp == 1, "run.fp8", "None with parallel.tp > 1 (fp8 linears do not take "
             "tensor-parallel DTensor weights yet)")
        need(isinstance(r.fp8_stats_every, int) and r.fp8_stats_every >= 1, "run.fp8_stats_every", "an integer >= 1")
        for name in ("run.eval_every", "run.save_every"):
            section, attr = name.split(".")
            v = getattr(r, attr)
            need(isinstance(v, int) and v >= 0, name, "an integer >= 0 (0: only at the end)")
        need(r.target_accuracy is None or (isinstance(r.target_accuracy, (int, float))
                                           and 0 < r.target_accuracy <= 1), "run.target_accuracy",
             "None or a fraction in (0, 1]")
        need(r.max_minutes is None or (isinstance(r.max_minutes, (int, float)) and r.max_minutes > 0),
             "run.max_minutes", "None or a positive number")
        need(r.threads is None or (isinstance(r.threads, int) and r.threads > 0), "run.threads",
             "None or a positive integer")
        if r.profile_steps is not None:
            first, _ = parse_profile_steps(r.profile_steps)
            need(first <= r.steps, "run.profile_steps", f"a window that starts by the last step (run.steps = {r.steps})")
        rows = d.batch_size // (o.grad_accum * p.dp) if d.batch_size % (o.grad_accum * p.dp) == 0 else 0
        need(rows > 0, "data.batch_size", f"a multiple of optim.grad_accum * parallel.dp ({o.grad_accum * p.dp})")
        _check_microbatches(rows, p)
        if d.path is None and "recall" in parts:
            need(d.num_queries <= d.num_pairs, "data.num_queries", f"at most data.num_pairs ({d.num_pairs})")
        return self

    def check_model(self, model_config: ModelConfig, world_size: int) -> None:
        """The checks against the model (and the layout against the world), before any data is read or any
        process group exists; errors name the run's field (`parallel.ep`, `data.seq_len`)."""
        limit = model_config.max_position_embeddings
        if self.data.seq_len > limit:  # would train out of range, then evaluate or allocate without end
            raise ConfigError(f"expected at most the model's max_position_embeddings ({limit}), got "
                              f"{self.data.seq_len}", field="data.seq_len", hint="lower --seq-len")
        try:
            self.parallel.check_layout(model_config, world_size)
        except ConfigError as e:
            names = {f.name for f in dataclasses.fields(ParallelDims)}
            field = f"parallel.{e.field}" if e.field in names else e.field
            raise ConfigError(str(e), field=field, hint=e.hint) from None

    @property
    def micro_batch_size(self) -> int:
        """Rows one data rank runs per micro-step."""
        return self.data.batch_size // (self.optim.grad_accum * self.parallel.dp)


def _check_microbatches(rows: int, p: ParallelDims) -> None:
    """Each micro-step's rows on one data rank are split into `p.microbatches` equal pieces (a pipeline
    schedule's microbatches, or accumulation across data ranks): refuse what would fail at step 1."""
    if rows % p.microbatches != 0:
        raise ConfigError(f"expected a divisor of the {rows} rows each data rank runs per micro-step "
                          f"(data.batch_size / (optim.grad_accum * parallel.dp)), got {p.microbatches}",
                          field="parallel.microbatches", hint="--microbatches must divide the local batch")


def _sections() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)}


def parse_profile_steps(text: str) -> tuple[int, int]:
    """"A:B" -> (A, B): profile steps A..B-1 (1-based), like a Python slice."""
    try:
        a, b = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ConfigError(f"expected 'A:B' with integers A < B, got {text!r}", field="run.profile_steps") from None
    if not 1 <= a < b:
        raise ConfigError(f"expected 1 <= A < B, got {text!r}", field="run.profile_steps")
    return a, b


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The nested dict of a .toml, .yaml/.yml or .json training config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", field="config")
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                raise ValueError(str(e)) from e
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{path}: expected a .toml, .yaml, .yml or .json file", field="config")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}", field="config") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as e:  # incl. UnicodeDecodeError
        raise ConfigError(f"{path} cannot be parsed: {e}", field="config") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of sections at the top level", field="config")
    return data


def resolve_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- file <- flags (dotted keys), validated."""
    cfg = TrainConfig()
    if file is not None:
        cfg.update(read_config_file(file))
    cfg.update(overrides or {})
    return cfg.validate()
