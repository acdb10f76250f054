"""The training loop: data -> step -> metrics / eval / checkpoint / profile, on one process or
under torchrun.

Order matters for errors: the config, the model config and the data (a missing file) are
checked before any process group exists, so a bad run fails fast with one ConfigError on
every rank instead of a hang.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from deltamoe.config import ModelConfig
from deltamoe.errors import TrainingError
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.output_paths import check_output_folder
from deltamoe.parallel.dims import launch_world_size
from deltamoe.parallel.mesh import ParallelMesh, init_distributed
from deltamoe.parallel.compose import parallelize
from deltamoe.train import checkpoint
from deltamoe.train.balance import SequenceBalanceLoss
from deltamoe.train.config import TrainConfig, parse_profile_steps
from deltamoe.train.data import DataSource, build_data
from deltamoe.train.evaluate import evaluate, summarize
from deltamoe.train.fp8 import Fp8Training
from deltamoe.train.model_setup import build_train_model, resolve_model_config
from deltamoe.train.optim import Optimizers
from deltamoe.train.profiling import StepProfiler
from deltamoe.train.resume_check import check_resume_config
from deltamoe.train.run_log import RunLog
from deltamoe.train.step import TrainStep
from deltamoe.threads import choose_threads


@dataclass
class RunResult:
    out: Path
    step: int
    final_eval: dict[str, Any] | None
    metrics: list[dict[str, Any]] = field(default_factory=list)  # this run's records (logging rank)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def train(cfg: TrainConfig) -> RunResult:
    world = launch_world_size()
    cfg.validate(world)
    # The default shares the idle cores among local ranks; the count used goes into train_config.json.
    cfg.run.threads = choose_threads(cfg.run.threads)
    torch.set_num_threads(cfg.run.threads)
    model_config = resolve_model_config(cfg.model)
    cfg.check_model(model_config, world)
    data = build_data(cfg, model_config)
    check_output_folder(cfg.run.out, "run.out")  # a folder that is a file or unwritable: now, not at the first save
    _check_out_checkpoints(cfg)
    owns_group = not (dist.is_available() and dist.is_initialized())
    mesh = init_distributed(cfg.parallel)
    try:
        return Trainer(cfg, model_config, data, mesh).run()
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:  # once per run, not once per rank
            _say_interrupted(Path(cfg.run.out))
        raise
    finally:
        if owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _say_interrupted(out: Path) -> None:
    """A Ctrl-C ends the run where it is: say what it left and how to go on from there."""
    latest = checkpoint.latest_checkpoint(out) if out.is_dir() else None
    where = (f"the newest checkpoint is {latest}: continue with --resume --out {out}" if latest is not None
             else "no checkpoint was saved (--save-every N saves along the way)")
    print(f"training interrupted; {where}", file=sys.stderr, flush=True)


def _check_out_checkpoints(cfg: TrainConfig) -> None:
    """A new run into a folder holding another run's checkpoints, or a resume from an earlier one
    than a folder's newest, is refused before the model is built (`checkpoint.check_no_later_checkpoints`)."""
    run = cfg.run
    if run.resume_from:
        start = checkpoint.step_of(Path(run.resume_from))
        if start is not None:  # a folder named otherwise: its step is known once it is read
            checkpoint.check_no_later_checkpoints(Path(run.out), start, resuming=True)
    elif not run.resume:
        checkpoint.check_no_later_checkpoints(Path(run.out), 0, resuming=False)


class Trainer:
    def __init__(self, cfg: TrainConfig, model_config: ModelConfig, data: DataSource, mesh: ParallelMesh | None):
        """`cfg` validated and its layout checked against the model; `mesh` from `init_distributed`."""
        self.cfg, self.model_config, self.data, self.dims = cfg, model_config, data, cfg.parallel
        self.out = Path(cfg.run.out)
        self.device = _device()
        self.world = 1 if mesh is None else mesh.size()
        self.rank = dist.get_rank() if self.world > 1 else 0
        torch.manual_seed(cfg.run.seed)
        model = build_train_model(cfg.model, model_config, cfg.run.seed, self.device)
        self.fp8 = Fp8Training(cfg.run.fp8, cfg.run.fp8_stats_every) if cfg.run.fp8 else None
        self.pm = parallelize(model, self.dims, mesh, [self.fp8] if self.fp8 else [])
        self.parts = self.pm.model_parts
        self.optimizers = Optimizers(self.parts, cfg.optim, cfg.run.steps)
        # Gradients of each forward_backward are summed over data ranks and pipeline microbatches.
        grad_scale = 1.0 / (self.pm.dp_size * self.dims.microbatches)
        self.seq_balance = (SequenceBalanceLoss(list(self.pm.moe_layers.values()), cfg.balance.alpha, grad_scale)
                            if cfg.balance.alpha > 0 else None)
        self.step_fn = TrainStep(self.pm, self.optimizers, self.seq_balance, cfg, self.device)
        self.log = RunLog(self.out, self.pm.is_logging_rank())
        self.state = checkpoint.TrainState()

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self._maybe_resume()
        # The record of the original run stays: a resume writes the configs only into a new run folder.
        configs = ({} if resumed and (self.out / "train_config.json").exists() else
                   {"train_config.json": cfg.to_dict(), "model_config.json": self.model_config.to_dict()})
        self.log.start(configs, self.state.step if resumed else None, cfg.run.steps, cfg.run.progress)
        window = parse_profile_steps(cfg.run.profile_steps) if cfg.run.profile_steps else None
        profiler = StepProfiler(window, self.state.step + 1, self.out, self.rank)
        last_eval: dict[str, Any] | None = None
        last_saved = self.state.step if resumed else None
        t_start = time.perf_counter()
        try:
            for step in range(self.state.step + 1, cfg.run.steps + 1):
                t0 = time.perf_counter()
                if self.fp8 is not None:
                    self.fp8.begin_step(step, cfg.run.steps)
                record = self.step_fn(step, self._micro_batches())
                if self.fp8 is not None and self.fp8.recording:  # this rank's quantisation error per module
                    record["fp8_error"] = self.fp8.take()
                if self.pm.offload_stats is not None:  # saved activations this rank sent to host memory
                    record["offload_moved_bytes"] = self.pm.offload_stats.take()
                self._check_finite(step, record, last_saved)
                self._advance()
                dt = time.perf_counter() - t0
                tokens = cfg.data.batch_size * cfg.data.seq_len
                self.log.step({"step": step, **record, "tokens_per_s": tokens / dt, "step_time_s": dt,
                               "tokens": self.state.tokens, "elapsed_s": time.perf_counter() - t_start},
                              write=step % cfg.run.log_every == 0 or step == cfg.run.steps)
                # A step's evaluation and save belong to its profiled step (as in torchtitan), labelled,
                # not to the next one's.
                if cfg.run.eval_every and step % cfg.run.eval_every == 0:
                    with record_function("deltamoe.evaluate"):
                        last_eval = self._evaluate(step)
                if cfg.run.save_every and step % cfg.run.save_every == 0:
                    with record_function("deltamoe.checkpoint_save"):
                        self._save()
                    last_saved = step
                profiler.step()
                if self._reached_target(last_eval, step) or self._out_of_time(t_start):
                    break
            profiler.close()  # the closing evaluation stays out of the trace
            if last_eval is None or last_eval["step"] != self.state.step:
                last_eval = self._evaluate(self.state.step)
        finally:
            profiler.close()
            self.log.close()
        if last_saved != self.state.step:
            self._save()
        self._export()
        self.log.finish(last_eval, f"{self.data.name} · {cfg.model.path or cfg.model.preset}", self.state.step,
                        "no held-out rows to evaluate" if self.data.eval_rows == 0 else "")
        return RunResult(self.out, self.state.step, last_eval, self.log.records)

    # ------------------------------------------------------------------ pieces
    def _check_finite(self, step: int, record: dict[str, Any], last_saved: int | None) -> None:
        """Stop on a NaN/inf loss or gradient norm: the update has already spoiled the weights, so
        nothing more is saved or exported and the last checkpoint stays the last good one. The
        gradient norm is global, so every rank stops at the same step."""
        bad = {k: record[k] for k in ("loss", "grad_norm") if not math.isfinite(record[k])}
        if not bad:
            return
        good = (checkpoint.latest_checkpoint(self.out) or self.cfg.run.resume_from) if last_saved is not None else None
        kept = f"the last good checkpoint is {good}" if good else "no checkpoint was saved"
        raise TrainingError(f"step {step}: non-finite {', '.join(f'{k} {v}' for k, v in bad.items())}; "
                            f"stopped, {kept}", field="train",
                            hint=("resume from it with a lower --lr or --clip-grad, or check the data" if good else
                                  "start again with a lower --lr or --clip-grad (and --save-every N), or check the data"))

    def _save(self) -> None:
        checkpoint.save(self.out, self.parts, self.optimizers, self.state, self.cfg.run.keep_checkpoints,
                        self.cfg.to_dict())

    def _micro_batches(self):
        """This rank's rows for each micro-step: the global step batch is [position, position + batch_size);
        micro-step m covers a contiguous block of it, split across the data ranks."""
        cfg, pos = self.cfg, self.state.data_position
        per_micro = cfg.data.batch_size // cfg.optim.grad_accum
        b = cfg.micro_batch_size
        return [self.data.rows("train", pos + m * per_micro + self.pm.dp_rank * b, b)
                for m in range(cfg.optim.grad_accum)]

    def _advance(self) -> None:
        self.state.step += 1
        self.state.data_position += self.cfg.data.batch_size
        self.state.tokens += self.cfg.data.batch_size * self.cfg.data.seq_len

    def _out_of_time(self, t_start: float) -> bool:
        """The time budget, decided by rank 0's clock so that every rank stops at the same step."""
        if self.cfg.run.max_minutes is None:
            return False
        elapsed = time.perf_counter() - t_start
        late = torch.tensor([float(elapsed > 60 * self.cfg.run.max_minutes)], device=self.device)
        if self.world > 1:
            dist.broadcast(late, src=0)
        return bool(late.item())

    def _reached_target(self, result: dict[str, Any] | None, step: int) -> bool:
        """Early stop for time-to-quality runs; every rank sees the same all-reduced accuracy."""
        target = self.cfg.run.target_accuracy
        return (target is not None and result is not None and result["step"] == step
                and result.get("accuracy") is not None and result["accuracy"] >= target)

    def _evaluate(self, step: int) -> dict[str, Any] | None:
        if self.data.eval_rows == 0:
            return None
        autocast = self.step_fn.autocast() if self.cfg.run.precision == "bf16" else None
        # No activations are kept for backward, so eval runs the whole per-step rows at once.
        rows = self.cfg.micro_batch_size * self.cfg.optim.grad_accum
        sums = evaluate(self.pm, self.data, rows, autocast)
        sums = self.pm.all_reduce_eval_sums(sums.to(self.device)).cpu()
        result = {"step": step, **summarize(sums, self.data.scores_answers)}
        self.log.evaluated(result)
        return result

    def _maybe_resume(self) -> bool:
        run = self.cfg.run
        if run.resume_from:
            path: Path | None = Path(run.resume_from)
        else:
            path = checkpoint.latest_checkpoint(self.out) if run.resume else None
        if path is None:
            if run.resume and self.pm.is_logging_rank():  # as torchtitan, a fresh start; but say so
                print(f"--resume: no checkpoint in {checkpoint.checkpoint_dir(self.out)} yet: starting a new run",
                      file=sys.stderr, flush=True)
            return False
        field = "run.resume_from" if run.resume_from else "run.resume"
        checkpoint.check_loadable(path, field)  # manifest and index first: the config compared here is read from it
        check_resume_config(path, self.cfg.to_dict(), self.out, self.pm.is_logging_rank())
        self.state = checkpoint.load(path, self.parts, self.optimizers, verified=True)
        return True

    def _export(self) -> None:
        """The final weights as an HF-style safetensors folder that `load_model` and serving read."""
        if self.world == 1:
            save_checkpoint(self.parts[0], self.out / "model")
            return
        # Sharded or split over stages: rebuild the full model on rank 0 from the final DCP
        # checkpoint (DCP reshards to whatever asks), rather than gathering every layout by hand.
        dist.barrier()
        if self.rank == 0:
            full = build_model(self.model_config)
            checkpoint.load_model_weights(checkpoint.latest_checkpoint(self.out), full)
            save_checkpoint(full, self.out / "model")
        dist.barrier()
