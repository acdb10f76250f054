"""Multi-step decode (`EngineConfig.num_scheduler_steps`, `--num-scheduler-steps N`): up to N decode
steps back to back, without returning to the scheduler between them (vLLM's multi-step scheduling).

A step of a batch of decodes spends most of a small model's time outside the model: scheduling,
planning the call, reading the sampled tokens back, building outputs. A window of N steps pays the
scheduling and planning once: blocks for all N tokens are allocated up front, each step's sampled
tokens are fed straight back as the next step's inputs (on the device, no host read), and the
positions advance by one per step. After the window the host reads the N x B tokens at once and
hands them to the engine one token at a time (`emit_speculative`, as a verification's run), so stop
tokens, stop strings, max_tokens, block publishing and prefix snapshots behave as one step at a
time; a request that finishes inside the window drops the tokens it sampled after its finish, and
its memory (the extra blocks included) goes back as usual. A row that passes a KDA snapshot boundary
it keeps (`HybridCache.takes_snapshot`) inside the window has its state copied aside at that step;
when the engine publishes that boundary the copy is put back into the slot for the snapshot, then
the state after the window (the restore of a verification's run, `spec_decode/step_result.py`).

When a window runs (else the readable one-step path, `ModelRunner.execute`):
- every item of the scheduled batch is a decode of a request that already has an output token (so a
  prompt's last token, a prefill, and therefore time to first token, is never part of a window);
- no row needs host work per token inside the window: no grammar, no penalties (they count the
  tokens sampled so far), no logprobs, no forked choices waiting, no images;
- the window is at most the tokens any row has left (max_tokens), so no row runs past its limit;
- the blocks for the whole window fit without preempting anyone; else one step.
Requests arriving meanwhile wait for the window's end (up to N - 1 steps longer than one step at a
time): the cost of fewer trips through the scheduler.

Sampling inside the window draws from each request's own generator in the same order as one step
at a time (`sampling.draw_tokens`), so greedy and seeded outputs are the one-step engine's, token
for token.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.multi_step_layouts import check_multi_step
from deltamoe.serve.engine.outputs import RequestOutput, merge_outputs
from deltamoe.serve.engine.runner import ModelRunner, StepResult
from deltamoe.serve.engine.sampling import draw_tokens
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.spec_decode.step_result import SpeculativeStepResult

# One state slot's KDA (recurrent, conv) states over every KDA layer.
SlotState = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(slots=True)
class MultiStepResult(SpeculativeStepResult):
    """One window's tokens for one request, emitted one at a time like a verification's run."""


def runs_in_window(seq: Sequence) -> bool:
    """Whether a decoding request needs no host work between its tokens (see the module docstring)."""
    p = seq.params
    return (seq.num_output_tokens >= 1 and seq.grammar is None and p.logprobs is None and p.presence_penalty == 0
            and p.frequency_penalty == 0 and not seq.forks and seq.images is None and seq.num_pending == 0)


class MultiStepDecode:
    """Runs a scheduled batch as a window of up to `num_steps` decode steps, or as one step."""

    def __init__(self, runner: ModelRunner, cache: HybridCache, num_steps: int):
        self.runner, self.cache, self.num_steps = runner, cache, num_steps
        self.windows = 0  # windows of more than one step run so far
        self.window_steps = 0  # decode steps those windows ran

    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        steps = self.window(batch)
        if steps <= 1:
            return self.runner.execute(batch)
        return self.run_window(batch, steps)

    def window(self, batch: ScheduledBatch) -> int:
        """Steps the batch can run back to back (1: one step), with the blocks for them allocated."""
        steps = self.num_steps
        for seq, n in batch.items:
            if n != 1 or not runs_in_window(seq):
                return 1
            steps = min(steps, seq.max_tokens - seq.num_output_tokens)
            if steps <= 1:
                return 1
        grown = []
        for seq, _ in batch.items:
            if not self.cache.grow(seq, seq.num_computed + steps):
                for other in grown:  # back to what one step needs: the scheduler's allocation
                    self.cache.release_tail(other, other.num_computed + 1)
                return 1
            grown.append(seq)
        return steps

    @torch.inference_mode()
    def run_window(self, batch: ScheduledBatch, steps: int) -> list[StepResult]:
        (group, call), = self.runner.plan(batch)  # decodes only: one call
        seqs = [seq for seq, _ in group]
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        no_outputs: list[list[int]] = [[] for _ in seqs]  # read by penalties only, which no row has here
        snapshots = self._snapshots_inside(seqs, steps)
        kept: dict[int, dict[int, SlotState]] = {row: {} for rows in snapshots.values() for row in rows}
        ids = None
        # The tables and slots are the window's for every step (its blocks are allocated up front):
        # the cache view is built once and continued, not rebuilt from the host lists each step.
        view = self.runner.batch_view(call)
        sampled: list[torch.Tensor] = []
        for step in range(steps):
            if step:
                view = view.next_decode_view() if view.gathers_pages else self.runner.batch_view(call)
            logits = self.runner.forward(call, ids, view=view)
            tokens = draw_tokens(logits, params, no_outputs, generators)
            sampled.append(tokens)
            for row in snapshots.get(step, ()):
                kept[row][step] = slot_state(self.cache, seqs[row].slot)
            ids = tokens.view(-1, 1)
            call = dataclasses.replace(call, past_lengths=[p + 1 for p in call.past_lengths])
        for row, states in kept.items():
            states[steps - 1] = slot_state(self.cache, seqs[row].slot)  # put back after the snapshots
        self.windows += 1
        self.window_steps += steps
        rows = torch.stack(sampled, dim=1).tolist()  # [B, steps]: the window's one read to the host
        bs = self.cache.block_size
        return [MultiStepResult(seq, 1, row[0], None, tokens=row, logprobs=[None] * steps, block_size=bs,
                                restore=self._restorer(seq.slot, kept[b]) if b in kept else None)
                for b, (seq, row) in enumerate(zip(seqs, rows))]

    def _snapshots_inside(self, seqs: list[Sequence], steps: int) -> dict[int, list[int]]:
        """step -> rows whose KDA state after that step is a kept snapshot, for steps before the last
        (after the last one the slot holds it anyway)."""
        if not (self.cache.prefix_caching and self.cache.layout.kda_layers):
            return {}
        bs, inside = self.cache.block_size, {}
        for row, seq in enumerate(seqs):
            first = -(-(seq.num_computed + 1) // bs) * bs  # the first boundary the window's steps reach
            for n in range(first, seq.num_computed + steps, bs):
                if self.cache.takes_snapshot(seq, n):
                    inside.setdefault(n - seq.num_computed - 1, []).append(row)
        return inside

    def _restorer(self, slot: int, kept: dict[int, SlotState]) -> Callable[[int], None]:
        """`restore(j)`: the state after the window's step j into the slot, where one was kept (called
        by `emit_speculative` at block boundaries, and after the last token once it restored one)."""
        def restore(j: int) -> None:
            if j in kept:
                put_slot_state(self.cache, slot, kept[j])

        return restore


def emit_window(take_token: Callable[[Sequence, int, None], RequestOutput], cache: HybridCache,
                r: MultiStepResult) -> RequestOutput | None:
    """A window's tokens for one row, taken as the engine takes each decode step's token
    (`LLMEngine._postprocess`: computed, committed, appended, `take_token`'s stop checks), with one
    output for the window (`outputs.merge_outputs`) instead of one per token. The tokens
    after a finish are dropped. For a row without a KDA snapshot inside the window (`r.restore` None;
    the engine sends the others through `emit_speculative`, which puts each kept state back): the
    cache's commit runs where a block fills, the only positions where it publishes a block or takes
    a snapshot (in between it does nothing)."""
    seq, block_size = r.seq, cache.block_size
    outputs: list[RequestOutput] = []
    for token in r.tokens:
        if seq.finished:  # a stop or max_tokens ended it: the remaining tokens are dropped
            break
        seq.num_computed += 1
        if seq.num_computed % block_size == 0:
            cache.commit(seq)
        seq.token_ids.append(token)
        outputs.append(take_token(seq, token, None))
    return merge_outputs(outputs)


def slot_state(cache: HybridCache, slot: int) -> SlotState:
    """A copy of one state slot's KDA recurrent and conv states, every KDA layer."""
    return cache.recurrent[:, slot].clone(), cache.conv[:, slot].clone()


def put_slot_state(cache: HybridCache, slot: int, state: SlotState) -> None:
    cache.recurrent[:, slot], cache.conv[:, slot] = state

def multi_step_decode(runner: ModelRunner, cache: HybridCache, config: EngineConfig, workers: bool,
                      transfers: bool) -> MultiStepDecode | None:
    """The engine's multi-step driver (None: one step at a time); refused with worker ranks or a KV
    connector (`multi_step_layouts.check_multi_step`)."""
    check_multi_step(config.num_scheduler_steps, workers, transfers)
    if config.num_scheduler_steps == 1:
        return None
    return MultiStepDecode(runner, cache, config.num_scheduler_steps)
