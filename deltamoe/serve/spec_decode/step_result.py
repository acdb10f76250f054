"""One verification's outcome, handed to the engine as the one-token results it already processes.

A verification computes the pending token and a kept drafts (a + 1 positions) and emits a + 1
tokens. `emit_speculative` feeds them to the engine's `_postprocess` one at a time, exactly as a+1
plain decode steps would arrive (so stop tokens, stop strings, max_tokens, logprobs, block
publishing and prefix snapshots behave as without speculation), and merges the outputs into one.
Before the engine publishes a block boundary that falls inside the run, the KDA state at that
position is put into the slot (a prefix snapshot must hold the state at its boundary); the last
part puts the state after the last kept draft there: the rollback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from deltamoe.serve.engine.outputs import RequestOutput, merge_outputs
from deltamoe.serve.engine.runner import StepResult
from deltamoe.serve.engine.sampling import TokenLogprob


@dataclass(slots=True)
class SpeculativeStepResult(StepResult):
    """`token`/`logprob` are the first emitted token's; `tokens`/`logprobs` all of them, in order."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    restore: Callable[[int], None] | None = None  # puts the KDA state after new position j into the slot
    block_size: int = 1
    num_drafts: int = 0  # drafts verified (K)


def emit_speculative(postprocess: Callable[[StepResult], RequestOutput | None],
                     r: SpeculativeStepResult) -> RequestOutput | None:
    seq, start = r.seq, r.seq.num_computed
    outputs: list[RequestOutput] = []
    restored = False  # the slot holds the state after the last draft until a restore
    for j, (token, logprob) in enumerate(zip(r.tokens, r.logprobs)):
        if seq.finished:  # a stop or max_tokens ended it: the remaining tokens are dropped
            break
        last = j == len(r.tokens) - 1
        boundary = (start + j + 1) % r.block_size == 0
        if r.restore is not None and (boundary or (last and (j < r.num_drafts or restored))):
            r.restore(j)
            restored = True
        out = postprocess(StepResult(seq, 1, token, logprob))
        if out is not None:
            outputs.append(out)
    return merge_outputs(outputs)
