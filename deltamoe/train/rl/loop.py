"""The GRPO loop, colocated: the trainer's policy and a serving engine in one process.

Each step: P train prompts -> the engine samples G completions each, with logprobs -> rewards ->
group-normalised advantages -> `updates_per_batch` clipped policy-gradient steps on the trainer's
policy -> its weights pushed into the engine (stage, then swap) -> the next step samples from them.
Every `eval_every` steps the engine answers held-out prompts greedily (exact-match accuracy).

The trainer recomputes the sampled tokens' logprobs before its first update; against the engine's
own logprobs that is the trainer-vs-engine mismatch (the same weights on both sides: ~0 unless the
two forwards differ). Ctrl-C (or any error) leaves the last completed step's checkpoint behind
(`train/checkpoint.py`: atomic DCP folders); `resume` continues from it.

Under torchrun (`--dp N`) the policy is FSDP2-sharded over the ranks (`policy.py`); rank 0 alone
owns the engine, samples, evaluates and logs, and hands every rank the step's batch. Before each
sync every rank gathers its shards (full tensors) and rank 0 pushes them into its engine.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deltamoe.errors import ConfigError, TrainingError
from deltamoe.output_paths import check_output_folder
from deltamoe.config import ModelConfig, load_preset
from deltamoe.hf_config import load_config
from deltamoe.model.load import build_model, load_model
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.weights import all_finite, save_checkpoint, write_json_atomic
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.weight_update import WeightUpdater
from deltamoe.parallel.dims import ParallelDims, launch_world_size
from deltamoe.parallel.mesh import ParallelMesh, build_mesh
from deltamoe.threads import choose_threads
from deltamoe.tokenizers.load import load_tokenizer
from deltamoe.train import checkpoint
from deltamoe.train.metrics import JsonlLog, read_jsonl, truncate_jsonl
from deltamoe.train.progress import RunProgress
from deltamoe.train.rl.accuracy import wilson_interval
from deltamoe.train.rl.batch import RolloutTensors, rollout_tensors
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.grpo import group_advantages
from deltamoe.train.rl.plots import plot_rl_curves
from deltamoe.train.rl.policy import PolicyTrainer
from deltamoe.train.rl.prompts import Prompt, TaskPrompts
from deltamoe.train.rl.rewards import exact_match, reward
from deltamoe.train.rl.rollout import EngineRollouts, Sample
from deltamoe.train.rl.weight_push import policy_tensors, push_in_process


@dataclass
class RLResult:
    out: Path
    step: int
    records: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[list[int]]:
    """Ctrl-C (SIGINT) or SIGTERM inside is caught into the yielded list instead of interrupting the
    block (main thread only; elsewhere the list stays empty and they act at once). Under torchrun a
    terminal's Ctrl-C reaches each worker twice (from the terminal's process group, then forwarded by
    torchrun, which kills the workers 30 s later); SIGTERM is how other launchers and schedulers stop
    a job. The step and, once a run stops, its save and export run inside this: a second signal
    arriving during the save used to cut it short, so the run was lost."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_policy(cfg: RLConfig) -> DeltaMoEForCausalLM:
    if cfg.init is not None:
        return load_model(cfg.init)
    return build_model(load_preset(cfg.preset), seed=cfg.seed)


def policy_config(cfg: RLConfig) -> ModelConfig:
    return load_config(cfg.init) if cfg.init is not None else load_preset(cfg.preset)


class RLRun:
    def __init__(self, cfg: RLConfig, mesh: ParallelMesh | None = None):
        """`mesh`: the data ranks' mesh under torchrun (`run_rl` builds it); None for one process."""
        self.cfg = cfg.validate()
        self.out = Path(cfg.out)
        self.rank = dist.get_rank() if mesh is not None else 0
        torch.set_num_threads(choose_threads(cfg.threads))
        torch.manual_seed(cfg.seed)
        policy = build_policy(cfg).train()
        self.model_config = config = policy.config
        self.tokenizer = load_tokenizer(cfg.init, config.vocab_size)
        self.prompts = TaskPrompts(cfg, self.tokenizer.bos_token_id)
        self.engine: LLMEngine | None = None
        if self.rank == 0:
            rows = cfg.prompts_per_step * cfg.group_size
            engine_model = copy.deepcopy(policy).eval().requires_grad_(False)
            self.engine = LLMEngine(engine_model, self.tokenizer,
                                    EngineConfig(max_num_seqs=max(rows, cfg.eval_prompts), max_num_batched_tokens=4096,
                                                 cache_memory="256MiB", block_size=16, seed=cfg.seed))
            self.updater = WeightUpdater(self.engine)
            self.rollouts = EngineRollouts(self.engine, cfg.rollout_retries, cfg.rollout_timeout_s)
        self.trainer = PolicyTrainer(policy, cfg, mesh)
        self.policy = self.trainer.module  # the model itself, or this rank's FSDP2 shard of it
        self.optimizers = self.trainer.optimizers
        self.state = checkpoint.TrainState()
        self.records: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the run
    def run(self) -> RLResult:
        cfg = self.cfg
        lead = self.rank == 0  # the engine's rank: rollouts, evaluation, logs
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self._maybe_resume()
        if not resumed and lead:
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
            write_json_atomic(self.out / "rl_config.json", cfg.to_dict())
        log = JsonlLog(self.out / "metrics.jsonl") if lead else None
        progress = RunProgress(cfg.steps, self.state.step, cfg.progress and lead)
        if self.engine is not None:
            # The engine counts the updates it took; a resumed run's fresh engine continues the
            # numbering of the run it resumes (after step k the engine holds version k + 1), so
            # metrics.jsonl's weight_version never restarts mid-file.
            self.updater.version = self.state.step
        sync_s = self._sync()[0]  # the engine starts from the trainer's weights
        interrupted = spoiled = False
        saved = self.state.step if resumed else None
        try:
            if not resumed and lead:
                self._log(log, progress, {"step": 0, **self._evaluate(), "sync_s": sync_s})
            for step in range(self.state.step + 1, cfg.steps + 1):
                with _interrupt_deferred() as caught:  # a step is done whole or not at all
                    record = self._step(step)
                    if lead and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                        record.update(self._evaluate())
                    if lead:
                        self._log(log, progress, record)
                if self._any_rank(bool(caught)):  # every rank stops after the same step
                    raise KeyboardInterrupt
                if cfg.save_every and step % cfg.save_every == 0:
                    self._save()
                    saved = step
        except KeyboardInterrupt:
            interrupted = True
        except TrainingError:  # the policy turned non-finite: nothing more is saved from it
            spoiled = True
            raise
        finally:
            if log is not None:
                log.close()
            progress.close()
            with _interrupt_deferred():  # a second Ctrl-C must not cut the save short
                if saved != self.state.step and not spoiled:
                    self._save()
            records = read_jsonl(self.out / "metrics.jsonl") if lead else []
            if records and cfg.plot:
                plot_rl_curves(records, self.out / "curves.png", f"GRPO · {cfg.task} · {cfg.init or cfg.preset}")
        with _interrupt_deferred():
            self._export()
        return RLResult(self.out, self.state.step, self.records, interrupted)

    def _log(self, log: JsonlLog, progress: RunProgress, record: dict[str, Any]) -> None:
        self.records.append(record)
        log.write(record)
        if record.get("eval_accuracy") is not None:
            progress.evaluated({"accuracy": record["eval_accuracy"]})
        if record["step"] > 0:
            progress.update(record["step"], record)

    # ------------------------------------------------------------------ one step
    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        cpu = time.process_time()
        record, batch = self._share(self._rollout(step) if self.rank == 0 else None)
        start = time.perf_counter()
        if batch is not None:
            record.update(self.trainer.update(batch, step))
        self.state.step = step
        self.state.data_position += cfg.prompts_per_step
        self.state.tokens += record["rollout_tokens"]
        record["train_s"] = time.perf_counter() - start
        record["sync_s"], record["weight_version"] = self._sync()
        record["cpu_s"] = time.process_time() - cpu  # this process's CPU time: wall time without the load
        return record

    def _rollout(self, step: int) -> tuple[dict[str, Any], RolloutTensors | None]:
        """Rank 0: the step's samples, rewards and advantages; the record so far and the training batch."""
        cfg = self.cfg
        prompts = self.prompts.batch("train", self.state.data_position, cfg.prompts_per_step)
        params = [self.params(p, cfg.temperature, logprobs=0) for p in prompts]
        rollout = self.rollouts.sample(prompts, cfg.group_size, params, seed=cfg.seed * 1_000_003 + step)
        groups = [g for g in rollout.groups if len(g) >= 2]  # a group needs two completions to compare
        samples = [s for g in groups for s in g]
        rewards = [[self._reward(s) for s in g] for g in groups]
        flat = [r for g in rewards for r in g]
        record: dict[str, Any] = {
            "step": step, "rollout_s": rollout.seconds, "rollout_tokens": rollout.tokens,
            "tokens_per_s": rollout.tokens / max(rollout.seconds, 1e-9), "retried": rollout.retried,
            "dropped": rollout.dropped, "groups": len(groups),
            "reward_mean": sum(flat) / len(flat) if flat else None,
            "reward_std": float(torch.tensor(flat).std(unbiased=False)) if flat else None,
            "accuracy": (sum(exact_match(s.text, s.prompt.answer) for s in samples) / len(samples)) if samples else None}
        if not samples:
            return record, None
        advantages = torch.cat([group_advantages(torch.tensor([g]), cfg.advantage_norm).flatten() for g in rewards])
        return record, rollout_tensors(samples, advantages.tolist(), self.model_config.pad_token_id or 0)

    def _share(self, payload: tuple[dict[str, Any], RolloutTensors | None] | None
               ) -> tuple[dict[str, Any], RolloutTensors | None]:
        """Rank 0's record and batch, on every rank."""
        if self.trainer.world == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _any_rank(self, flag: bool) -> bool:
        if self.trainer.world == 1:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _sync(self) -> tuple[float, int | None]:
        """Push the policy into the engine: (seconds, the engine's weight version). Every rank gathers
        its shards (a collective); rank 0 pushes."""
        start = time.perf_counter()
        tensors = policy_tensors(self.policy)
        # Every rank holds the gathered tensors, so every rank stops here alike (as `deltamoe train`
        # stops on a non-finite loss); the engine would refuse them anyway, as a weight update.
        bad = next((name for name, t in tensors.items() if not all_finite(t)), None)
        if bad is not None:
            last = checkpoint.latest_checkpoint(self.out)
            kept = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was saved"
            raise TrainingError(f"after step {self.state.step} the policy's {bad} holds non-finite values; stopped, "
                                f"{kept}", field="train", hint="resume from it with a lower --lr, or check the rewards")
        if self.engine is None:
            return time.perf_counter() - start, None
        stats = push_in_process(self.updater, tensors)
        return time.perf_counter() - start, stats.version

    def params(self, prompt: Prompt, temperature: float, logprobs: int | None = None) -> SamplingParams:
        """Where a completion ends (`RLConfig.completion`): at the answer's length, or at EOS within
        the longest answer + 1 tokens."""
        if self.cfg.completion == "answer":
            return SamplingParams(max_tokens=len(prompt.answer.encode()), temperature=temperature, logprobs=logprobs,
                                  ignore_eos=True)
        return SamplingParams(max_tokens=self.prompts.max_answer_len + 1, temperature=temperature, logprobs=logprobs)

    def _reward(self, s: Sample) -> float:
        expected_finish = "length" if self.cfg.completion == "answer" else "stop"
        return reward(s.text, s.finish_reason, s.prompt.answer, expected_finish, self.prompts.alphabet,
                      self.cfg.format_reward)

    # ------------------------------------------------------------------ evaluation, checkpoints
    def _evaluate(self) -> dict[str, Any]:
        """Held-out exact-match accuracy of the engine's greedy answers (the engine holds the trainer's
        weights), with its 95 % Wilson interval."""
        prompts: list[Prompt] = self.prompts.batch("eval", 0, self.cfg.eval_prompts)
        done = self.engine.generate([p.token_ids for p in prompts], [self.params(p, 0.0) for p in prompts],
                                    progress=False)
        correct = int(sum(exact_match(c.text, p.answer) for c, p in zip(done, prompts)))
        return {"eval_accuracy": correct / len(prompts), "eval_ci95": list(wilson_interval(correct, len(prompts)))}

    def _save(self) -> None:
        checkpoint.save(self.out, self.trainer.parts, self.optimizers, self.state, self.cfg.keep_checkpoints,
                        self.cfg.to_dict())

    def _export(self) -> None:
        """The final policy as a safetensors folder (`model/`) that `deltamoe serve` loads: rank 0
        writes the gathered full tensors."""
        if self.trainer.world == 1:
            save_checkpoint(self.policy, self.out / "model")
            return
        tensors = policy_tensors(self.policy)
        if self.rank == 0:
            full = build_model(self.model_config)
            full.load_state_dict(tensors)
            save_checkpoint(full, self.out / "model")
        dist.barrier()

    def _maybe_resume(self) -> bool:
        path = checkpoint.latest_checkpoint(self.out) if self.cfg.resume else None
        if path is None:
            return False
        checkpoint.check_loadable(path, field="resume")  # manifest first: the config compared is read from it
        saved = checkpoint.read_saved_config(path)
        if saved is not None:
            self.cfg.check_resume(saved, str(path))
        at = checkpoint.read_train_state(Path(path) / "train_state.rank0.json")[0].step
        if at > self.cfg.steps:  # the loop would do nothing and export the checkpoint's policy silently
            raise ConfigError(f"{path} is at step {at}, beyond steps={self.cfg.steps}", field="steps",
                              hint=f"pass --steps {at} or more")
        self.state = checkpoint.load(path, self.trainer.parts, self.optimizers, verified=True)
        if self.rank == 0:
            truncate_jsonl(self.out / "metrics.jsonl", self.state.step)
        return True


def run_rl(cfg: RLConfig) -> RLResult:
    """One process, or one rank of `torchrun --nproc-per-node N ... --dp N` (the trainer FSDP2-sharded)."""
    cfg.validate()
    check_output_folder(cfg.out, "out")  # a file, an empty or unwritable path: now, not at the first save
    if not cfg.resume:  # another run's checkpoints there: its saves were pruned, --resume read the other run
        checkpoint.check_no_later_checkpoints(Path(cfg.out), 0, resuming=False, field="out")
    world = launch_world_size()
    dims = ParallelDims(dp=cfg.dp).resolve(policy_config(cfg), world)  # ConfigError before any process group
    if world == 1:
        return RLRun(cfg).run()
    owns_group = not dist.is_initialized()
    if owns_group:  # the loop's policy and engine live on the CPU: gloo, whatever accelerator is present
        dist.init_process_group("gloo")
    try:
        return RLRun(cfg, build_mesh(dims, "cpu")).run()
    finally:
        if owns_group:
            dist.destroy_process_group()
