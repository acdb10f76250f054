"""Rollouts from the serving engine: G sampled completions per prompt, each with its tokens' logprobs.

The engine is driven step by step here (not through `generate`) so that a failure never stalls the
loop: a request that ends with an error, or is caught in a step that raises, is retried up to
`retries` times with a fresh seed and then dropped; a batch still running after `timeout_s` is
aborted and its unfinished requests dropped. Every retry and drop is counted in the result.
Seeds are a function of (run seed, step, prompt, sample, attempt): a rerun samples the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.rl.prompts import Prompt


@dataclass
class Sample:
    prompt_index: int  # which prompt of the batch (its group)
    prompt: Prompt
    token_ids: list[int] = field(default_factory=list)  # the completion, the stop token included
    logprobs: list[float] = field(default_factory=list)  # the engine's logprob of each completion token
    text: str = ""
    finish_reason: str = ""


@dataclass
class RolloutBatch:
    groups: list[list[Sample]]  # per prompt, its completions that arrived (a group may be short)
    retried: int
    dropped: int
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for g in self.groups for s in g)


@dataclass
class _Pending:
    sample: Sample
    slot: int  # sample number within its group
    attempt: int = 0


class EngineRollouts:
    def __init__(self, engine: LLMEngine, retries: int, timeout_s: float, share_prompt: bool = True):
        """`share_prompt`: a group's choices 2..G fork choice 1's prefill (`serve/engine/forks.py`: the
        engine's n > 1), so a prompt is computed once per group; each choice still draws with its own
        seed from the same distribution. Retries run on their own."""
        self.engine, self.retries, self.timeout_s = engine, retries, timeout_s
        self.share_prompt = share_prompt

    def sample(self, prompts: list[Prompt], group_size: int, params: list[SamplingParams], seed: int) -> RolloutBatch:
        """`params[i]` (with logprobs=0) for prompt i's requests; each request gets its own seed."""
        start = time.perf_counter()
        deadline = start + self.timeout_s
        groups: list[list[Sample]] = [[] for _ in prompts]
        pending: dict[str, _Pending] = {}
        retried = dropped = 0

        children: dict[str, list[str]] = {}  # a parent's request id -> its forked choices' ids

        def submit(p: _Pending, fork_of: str | None = None) -> str:
            s = p.sample
            request_params = SamplingParams(**{**vars(params[s.prompt_index]),
                                               "seed": hash((seed, s.prompt_index, p.slot, p.attempt)) & (2**63 - 1)})
            rid = f"rl-{seed}-{s.prompt_index}-{p.slot}-{p.attempt}"
            p.sample = Sample(s.prompt_index, s.prompt)
            seq = self.engine.make_sequence(s.prompt.token_ids, request_params, request_id=rid)
            seq.fork_of = fork_of
            if fork_of is not None:
                children.setdefault(fork_of, []).append(rid)
            pending[self.engine.add_sequence(seq)] = p
            return rid

        def failed(p: _Pending) -> None:
            nonlocal retried, dropped
            if p.attempt < self.retries:
                retried += 1
                p.attempt += 1
                submit(p)
            else:
                dropped += 1

        for i, prompt in enumerate(prompts):
            parent = f"rl-{seed}-{i}-0-0" if self.share_prompt else None
            for j in range(1, group_size):  # forked choices reach the engine before their parent
                submit(_Pending(Sample(i, prompt), j), parent)
            submit(_Pending(Sample(i, prompt), 0))
        while pending:
            if time.perf_counter() > deadline:
                for rid in list(pending):
                    self.engine.abort(rid)
                dropped += len(pending)
                pending.clear()
                break
            try:
                outputs = self.engine.step()
            except Exception:  # the whole step is lost: every request in flight fails once
                lost = [pending.pop(rid) for rid in list(pending)]
                self.engine.abort_all()
                for p in lost:
                    failed(p)
                continue
            for out in outputs:
                p = pending.get(out.request_id)
                if p is None:
                    continue
                s = p.sample
                s.token_ids += out.delta_token_ids
                s.logprobs += [lp.logprob for lp in out.delta_logprobs or []]
                if not out.finished:
                    continue
                del pending[out.request_id]
                if out.finish_reason == "error":
                    self.engine.errors.pop(out.request_id, None)
                    for child in children.pop(out.request_id, []):  # choices still waiting on its prefill
                        if child in pending and self.engine.abort(child) is not None:
                            failed(pending.pop(child))
                    failed(p)
                else:
                    s.text, s.finish_reason = out.text, out.finish_reason or ""
                    groups[s.prompt_index].append(s)
        return RolloutBatch(groups, retried, dropped, time.perf_counter() - start)
