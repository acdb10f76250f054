"""The GRPO loop, colocated: the trainer's policy and a serving engine in one process.

Each step: P train prompts -> the engine samples G completions each, with logprobs -> rewards ->
group-normalised advantages -> `updates_per_batch` clipped policy-gradient steps on the trainer's
policy -> its weights pushed into the engine (stage, then swap) -> the next step samples from them.
Every `eval_every` steps the engine answers held-out prompts greedily (exact-match accuracy).

The trainer recomputes the sampled tokens' logprobs before its first update; against the engine's
own logprobs that is the trainer-vs-engine mismatch (the same weights on both sides: ~0 unless the
two forwards differ). Ctrl-C (or any error) leaves the last completed step's checkpoint behind
(`train/checkpoint.py`: atomic DCP folders); `resume` continues from it.
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

from deltamoe.config import load_preset
from deltamoe.model.load import build_model, load_model
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.weights import save_checkpoint, write_json_atomic
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.weight_update import WeightUpdater
from deltamoe.threads import choose_threads
from deltamoe.tokenizers.load import load_tokenizer
from deltamoe.train import checkpoint
from deltamoe.train.config import OptimSection
from deltamoe.train.metrics import JsonlLog, read_jsonl, truncate_jsonl
from deltamoe.train.optim import Optimizers
from deltamoe.train.progress import RunProgress
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.grpo import group_advantages, grpo_loss, token_logprobs
from deltamoe.train.rl.plots import plot_rl_curves
from deltamoe.train.rl.prompts import Prompt, TaskPrompts
from deltamoe.train.rl.rewards import exact_match, reward
from deltamoe.train.rl.rollout import EngineRollouts, Sample
from deltamoe.train.rl.weight_push import push_in_process


@dataclass
class RLResult:
    out: Path
    step: int
    records: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False


@dataclass
class _Batch:
    """The rollouts as training tensors: prompt + completion rows, right-padded."""

    ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1], 1 where position t predicts a completion token
    engine_logp: torch.Tensor  # [B, T-1], the engine's logprobs on the masked positions
    advantages: torch.Tensor  # [B]


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """Ctrl-C inside takes effect when the block is done (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def build_policy(cfg: RLConfig) -> DeltaMoEForCausalLM:
    if cfg.init is not None:
        return load_model(cfg.init)
    return build_model(load_preset(cfg.preset), seed=cfg.seed)


class RLRun:
    def __init__(self, cfg: RLConfig):
        self.cfg = cfg.validate()
        self.out = Path(cfg.out)
        torch.set_num_threads(choose_threads(cfg.threads))
        torch.manual_seed(cfg.seed)
        self.policy = build_policy(cfg).train()
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)  # the initial policy, for the KL
        config = self.policy.config
        self.tokenizer = load_tokenizer(cfg.init, config.vocab_size)
        self.prompts = TaskPrompts(cfg, self.tokenizer.bos_token_id)
        rows = cfg.prompts_per_step * cfg.group_size
        engine_model = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.engine = LLMEngine(engine_model, self.tokenizer,
                                EngineConfig(max_num_seqs=max(rows, cfg.eval_prompts), max_num_batched_tokens=4096,
                                             cache_memory="256MiB", block_size=16, seed=cfg.seed))
        self.updater = WeightUpdater(self.engine)
        self.rollouts = EngineRollouts(self.engine, cfg.rollout_retries, cfg.rollout_timeout_s)
        total = cfg.steps * cfg.updates_per_batch
        self.optimizers = Optimizers([self.policy], OptimSection(lr=cfg.lr, warmup_steps=0, weight_decay=0.0,
                                                                 min_lr_ratio=1.0, clip_grad=cfg.max_grad_norm),
                                     total)
        self.state = checkpoint.TrainState()
        self.records: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the run
    def run(self) -> RLResult:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self._maybe_resume()
        if not resumed:
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
            write_json_atomic(self.out / "rl_config.json", cfg.to_dict())
        log = JsonlLog(self.out / "metrics.jsonl")
        progress = RunProgress(cfg.steps, self.state.step, cfg.progress)
        sync = push_in_process(self.updater, self.policy)  # the engine starts from the trainer's weights
        interrupted = False
        saved = self.state.step if resumed else None
        try:
            if not resumed:
                self._log(log, progress, {"step": 0, "eval_accuracy": self._evaluate(), "sync_s": sync.swap_s})
            for step in range(self.state.step + 1, cfg.steps + 1):
                with _interrupt_after():  # a step is done whole or not at all: a checkpoint never holds half of one
                    record = self._step(step)
                    if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                        record["eval_accuracy"] = self._evaluate()
                    self._log(log, progress, record)
                if cfg.save_every and step % cfg.save_every == 0:
                    self._save()
                    saved = step
        except KeyboardInterrupt:
            interrupted = True
        finally:
            log.close()
            progress.close()
            if saved != self.state.step:
                self._save()
            records = read_jsonl(self.out / "metrics.jsonl")
            if records and cfg.plot:
                plot_rl_curves(records, self.out / "curves.png", f"GRPO · {cfg.task} · {cfg.init or cfg.preset}")
        save_checkpoint(self.policy, self.out / "model")
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
        start = time.perf_counter()
        if samples:
            advantages = torch.cat([group_advantages(torch.tensor([g])).flatten() for g in rewards])
            record.update(self._train(self._batch(samples, advantages), step))
        self.state.step = step
        self.state.data_position += cfg.prompts_per_step
        self.state.tokens += rollout.tokens
        record["train_s"] = time.perf_counter() - start
        sync = push_in_process(self.updater, self.policy)
        record["sync_s"] = sync.receive_s + sync.swap_s
        record["weight_version"] = sync.version
        return record

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

    def _batch(self, samples: list[Sample], advantages: torch.Tensor) -> _Batch:
        width = max(len(s.prompt.token_ids) + len(s.token_ids) for s in samples)
        pad = self.policy.config.pad_token_id or 0
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        mask = torch.zeros(len(samples), width - 1)
        engine_logp = torch.zeros(len(samples), width - 1)
        for row, s in enumerate(samples):
            p, c = len(s.prompt.token_ids), len(s.token_ids)
            ids[row, :p + c] = torch.tensor(s.prompt.token_ids + s.token_ids)
            mask[row, p - 1:p - 1 + c] = 1.0  # position t predicts token t + 1
            engine_logp[row, p - 1:p - 1 + c] = torch.tensor(s.logprobs)
        return _Batch(ids, mask, engine_logp, advantages.float())

    def _train(self, b: _Batch, step: int) -> dict[str, Any]:
        cfg, on = self.cfg, b.mask.bool()
        with torch.no_grad():
            logits = self.policy(b.ids).logits
            old = token_logprobs(logits, b.ids, cfg.temperature)
            gap = (token_logprobs(logits, b.ids) - b.engine_logp)[on].abs()  # raw logprobs, as the engine reports
            ref = token_logprobs(self.reference(b.ids).logits, b.ids, cfg.temperature)
        parts = []
        for u in range(cfg.updates_per_batch):
            lr = self.optimizers.set_lr((step - 1) * cfg.updates_per_batch + u + 1)
            logp = token_logprobs(self.policy(b.ids).logits, b.ids, cfg.temperature)
            result = grpo_loss(logp, old, b.advantages, b.mask, cfg.clip_eps, ref, cfg.kl_coef)
            result.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm))
            self.optimizers.step()
            self.optimizers.zero_grad()
            parts.append((result, grad_norm))
        return {"loss": sum(float(r.loss.detach()) for r, _ in parts) / len(parts),
                "policy_loss": sum(r.policy_loss for r, _ in parts) / len(parts),
                "kl": parts[-1][0].kl, "clip_fraction": sum(r.clip_fraction for r, _ in parts) / len(parts),
                "grad_norm": parts[-1][1], "lr": lr, "completion_tokens": int(on.sum()),
                "logprob_mismatch": float(gap.mean()) if gap.numel() else 0.0,
                "logprob_mismatch_max": float(gap.max()) if gap.numel() else 0.0,
                "advantage_nonzero": float((b.advantages.abs() > 0).float().mean())}

    # ------------------------------------------------------------------ evaluation, checkpoints
    def _evaluate(self) -> float:
        """Held-out exact-match accuracy of the engine's greedy answers (the engine holds the trainer's weights)."""
        prompts: list[Prompt] = self.prompts.batch("eval", 0, self.cfg.eval_prompts)
        done = self.engine.generate([p.token_ids for p in prompts], [self.params(p, 0.0) for p in prompts],
                                    progress=False)
        return sum(exact_match(c.text, p.answer) for c, p in zip(done, prompts)) / len(prompts)

    def _save(self) -> None:
        checkpoint.save(self.out, [self.policy], self.optimizers, self.state, self.cfg.keep_checkpoints,
                        self.cfg.to_dict())

    def _maybe_resume(self) -> bool:
        path = checkpoint.latest_checkpoint(self.out) if self.cfg.resume else None
        if path is None:
            return False
        self.state = checkpoint.load(path, [self.policy], self.optimizers)
        truncate_jsonl(self.out / "metrics.jsonl", self.state.step)
        return True


def run_rl(cfg: RLConfig) -> RLResult:
    return RLRun(cfg).run()

