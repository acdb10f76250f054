"""n > 1 choices from one prefill: choices 2..n fork choice 1's cache when its prompt is computed.

A request for n choices arrives as n sequences; all but the first name it in `fork_of` and reach
the engine first (the server sends them first, and commands are handled in order), so they wait
here, unscheduled, until the first ("parent") is added and then until its prefill ends. In that
step the runner samples each waiting child's first token from the parent's last-prompt logits
(its own seed, its own grammar), and `start_forks` gives each child the parent's cache: the full
prompt blocks shared by reference, the partial last block copied, the KDA state copied. Each
child then decodes as an ordinary sequence (preemption recomputes it like any other).

A parent's prompt logprobs (asked for with the same top-n by every choice) are copied to each child,
which would otherwise never score the prompt it did not compute.

Where the cache cannot fork (no free slot or block now, max_num_seqs running, the parent already finished, or the
cache is mirrored on tensor-parallel workers, whose page copies this does not replay) a child
keeps its first token and is queued to compute prompt and token itself: the same tokens, at the
cost of its own prefill (the prefix cache still serves the prompt's full blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltamoe.serve.engine.sampling import TokenLogprob, sample
from deltamoe.serve.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.runner import StepResult


class ForkBook:
    """Children waiting for a parent that has not arrived yet (by parent request id)."""

    def __init__(self) -> None:
        self.orphans: dict[str, list[Sequence]] = {}

    def hold(self, child: Sequence) -> None:
        self.orphans.setdefault(child.fork_of, []).append(child)

    def attach(self, parent: Sequence) -> None:
        parent.forks = self.orphans.pop(parent.request_id, [])

    def drop(self, seq: Sequence, parent: Sequence | None) -> bool:
        """Forget a waiting child (aborted); True if it was one."""
        for group in (self.orphans.get(seq.fork_of or "", []), parent.forks if parent is not None else []):
            if seq in group:
                group.remove(seq)
                return True
        return False


def sample_first_tokens(logits: torch.Tensor, parents: list[Sequence]) -> dict[int, list[tuple[int, TokenLogprob | None]]]:
    """Each waiting child's first token from its parent's logits row [V] (rows in `parents` order)."""
    picks = {}
    for row, parent in enumerate(parents):
        children = parent.forks
        if not children or parent.output_ids:
            continue
        allowed = [c.grammar.allowed() if c.grammar is not None else None for c in children]
        picks[id(parent)] = sample(logits[row].expand(len(children), -1), [c.params for c in children],
                                   [[] for _ in children], [c.generator for c in children], allowed)
    return picks


def start_forks(engine: LLMEngine, results: list[StepResult]) -> list[StepResult]:
    """Children of the parents whose prefill ended this step, started with their first tokens
    (to postprocess like any step result)."""
    from deltamoe.serve.engine.runner import StepResult

    started: list[StepResult] = []
    for r in results:
        parent = r.seq
        if r.forks is None:
            continue
        children, parent.forks = parent.forks, []
        for child, pick in zip(children, r.forks):
            if child.finished:
                continue
            if child.params.prompt_logprobs == parent.params.prompt_logprobs is not None:
                # The same prompt, scored once: a forked child never computes it (echo / prompt_logprobs).
                child.prompt_logprobs = list(parent.prompt_logprobs)
            room = len(engine.scheduler.running) + len(engine.scheduler.loading) < engine.config.max_num_seqs
            if room and not parent.finished and engine.cache.state_log is None and engine.cache.fork(parent, child):
                child.status = Status.RUNNING
                engine.scheduler.running.append(child)
            else:  # its own prefill, of the prompt and this first token (its generator has drawn it)
                engine.scheduler.add(child)
            started.append(StepResult(child, 0, *pick))
    return started


def with_fork_picks(batch, to_sample: list[Sequence], picks: list, fork_picks: dict) -> list[StepResult]:
    """The step's results, the parents' carrying their children's first tokens."""
    from deltamoe.serve.engine.runner import StepResult

    sampled = {id(s): p for s, p in zip(to_sample, picks)}
    return [StepResult(seq, n, *sampled.get(id(seq), (None, None)), fork_picks.get(id(seq))) for seq, n in batch.items]
