"""ModelRunner: the only place that touches the model. Packs a scheduled batch, runs it, samples.

Every row of one model call appends the same number of tokens, so the batch is split by chunk
length: all decodes (T = 1) go in one call, prefill chunks of equal length share a call. Only
the last position of each row goes through the final norm and LM head, and only rows that
reach the end of their tokens are sampled. Future workers (TP/EP under torchrun, speculative
verification, a prefill worker handing off blocks) replace or extend this class only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.serve.cache import HybridCache
from deltamoe.serve.cache_view import PagedBatchView
from deltamoe.serve.sampling import TokenLogprob, sample
from deltamoe.serve.scheduler import ScheduledBatch
from deltamoe.serve.sequence import Sequence


@dataclass
class StepResult:
    seq: Sequence
    num_computed: int  # tokens computed this step
    token: int | None  # the sampled next token, when the chunk reached the end of the sequence
    logprob: TokenLogprob | None


class ModelRunner:
    def __init__(self, model: DeltaMoEForCausalLM, cache: HybridCache):
        self.model = model
        self.cache = cache
        self.device = model.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        groups: dict[int, list[Sequence]] = {}
        for seq, n in batch.items:
            groups.setdefault(n, []).append(seq)
        last_logits: list[torch.Tensor] = []
        to_sample: list[Sequence] = []
        for n in sorted(groups):  # T = 1 (the decodes) first
            seqs = groups[n]
            logits = self._forward(seqs, n)
            rows = [row for row, seq in enumerate(seqs) if seq.num_computed + n == len(seq.token_ids)]
            if rows:  # one gather per call, not one select per row
                last_logits.append(logits if len(rows) == len(seqs) else logits[rows])
                to_sample.extend(seqs[row] for row in rows)
        sampled = {}
        if to_sample:
            picks = sample(torch.cat(last_logits), [s.params for s in to_sample], [s.output_ids for s in to_sample],
                           [s.generator for s in to_sample])
            sampled = {id(s): p for s, p in zip(to_sample, picks)}
        return [StepResult(seq, n, *sampled.get(id(seq), (None, None))) for seq, n in batch.items]

    def _forward(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        """One model call appending n tokens to each row -> last-position logits [B, V] (fp32)."""
        ids = torch.tensor([s.token_ids[s.num_computed:s.num_computed + n] for s in seqs], device=self.device)
        view = PagedBatchView(self.cache, [s.block_table for s in seqs], [s.num_computed for s in seqs],
                              [s.slot for s in seqs], n)
        # Norm + LM head on the last position only: prefill chunks need no other logits.
        return self.model(ids, cache=view, logits_to_keep=1).logits[:, -1].float()
