"""The batch-size rule (`EngineConfig.spec_max_batch`, vLLM's `speculative_disable_by_batch_size`):
a step whose running batch holds at least that many sequences runs as plain decode for every row,
through the compiled plain path where the engine compiles; drafting resumes when the batch shrinks.

Why a batch limit: a verification computes K + 1 positions per row and the MTP layer adds a
trunk layer's worth of work per drafted position. At batch 1 a CPU step is bound by per-op
overhead, so those extra positions cost little (a verification whose drafts all land costs
1.15 / 1.34 / 1.83 plain steps for K = 1 / 2 / 3, `bench/spec_step_split.py`) and the kept drafts
pay for it. As the batch grows the step turns bound by arithmetic and the extra positions cost
nearly their share: at batch 8 speculation decodes at about half the plain rate
(`bench/bench_spec_decode.py`). The default, 4, keeps speculation for batches 1..3 at most.
Under the limit the cost rule (`EngineConfig.spec_batch_rule = "cost"`, `step_costs.py`) decides
per batch size from step times the engine measures: a batch of 2 or 3 whose verification costs
more than the plain steps emitting the same tokens (at the acceptance its rows get) decodes
plainly too; "size" speculates at every batch size under the limit.

What a plain step owes the drafter: the MTP layer reads the trunk's hidden state at every
computed position (its attention latents are paged like a trunk layer's). The plain step keeps
each speculating row's hidden states (the compiled regions return them with the logits) and
defers the MTP layer's catch-up (`PendingCatchUp`): one MTP call over all the positions when the
row drafts again, and earlier whenever a block fills (a full block is published for prefix hits,
so its MTP latents must be complete by then). A step at the batch limit thus runs no MTP call
for most rows: one call per row every `block_size` tokens, over a block's positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltamoe.serve.engine.prompt_logprobs import chunk_prompt_logprobs, wants_prompt_logprobs
from deltamoe.serve.engine.runner import (ModelCall, ModelRunner, StepResult, pack_calls, sampled_rows,
                                          with_prompt_logprobs)
from deltamoe.serve.engine.sampling import TokenLogprob
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.spec_decode.mtp_drafter import CatchUp


def runs_plain(running: int, max_batch: int) -> bool:
    """Whether a step of `running` sequences runs as plain decode (`max_batch` 0: never)."""
    return max_batch > 0 and running >= max_batch


@dataclass
class PendingCatchUp:
    """Trunk hidden states of positions start .. start+T-1 that the MTP layer has not read yet."""

    start: int
    hidden: list[torch.Tensor] = field(default_factory=list)  # pieces [t_i, D], in position order
    length: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def add(self, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden)
        self.length += hidden.shape[0]

    def before(self, catch_up: CatchUp) -> CatchUp:
        """`catch_up` (positions from `end` on) with these positions first: one MTP call over both.
        The next tokens of the pending positions are the sequence's own tokens end+1 .. catch_up.start."""
        seq = catch_up.seq
        return CatchUp(seq, self.start, torch.cat(self.hidden + [catch_up.hidden]),
                       seq.token_ids[self.start + 1:self.end + 1] + catch_up.next_tokens, catch_up.draft)


def run_plain_keeping_hidden(runner: ModelRunner, batch: ScheduledBatch, compiled: bool = True
                             ) -> tuple[list[StepResult], dict[int, torch.Tensor]]:
    """The step as `ModelRunner` runs it (decodes through the compiled regions when it compiles and
    `compiled`, prefill chunks eager) -> its results and each row's hidden states [n, D] by
    `id(seq)`. `compiled` False: every call eager (the whole-call graph returns no hidden states).
    Image rows come with the calls (encoded by the runner before the step); a prefill chunk that asks
    for prompt logprobs projects its hidden states as `ModelRunner.run` does."""
    last_logits: list[torch.Tensor] = []
    to_sample: list[Sequence] = []
    hidden_by_seq: dict[int, torch.Tensor] = {}
    scored: dict[int, list[TokenLogprob]] = {}
    calls = [(group, ModelCall.of(group, compiled and runner.compiles_decode)) for group in pack_calls(batch.items)]
    for group, call in calls:
        logits, hidden = runner.forward(call, with_hidden=True)
        for b, (seq, n) in enumerate(group):
            hidden_by_seq[id(seq)] = hidden[b, :n]
            if wants_prompt_logprobs(seq):
                scored[id(seq)] = chunk_prompt_logprobs(runner.model, seq, n, hidden[b, :n] if max(call.counts) > 1
                                                        else None, logits[b])
        rows = sampled_rows(group)
        if rows:
            last_logits.append(logits if len(rows) == len(group) else logits[rows])
            to_sample.extend(group[row][0] for row in rows)
    results = runner.sample_rows(batch, last_logits, to_sample)
    return (with_prompt_logprobs(results, scored) if scored else results), hidden_by_seq
