"""ModelRunner: the only place that touches the model. Packs a scheduled batch, runs it, samples.

All decodes (T = 1) go in one model call; prefill chunks of different lengths share calls,
right-padded to the longest (`pack_calls` bounds the padding), with the real counts in the cache
view so padding never enters a state. Only each row's last real position goes through the final
norm and LM head, and only rows that reach the end of their tokens are sampled.

A step is first planned as `ModelCall`s, plain host data (token ids, block tables, past lengths,
slots), then each call runs: that split is what lets TP/EP workers (`serve/executor/`) run the
same calls on their shards from the data rank 0 sends them, while only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.model.ffn import MoE
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.expert_load import empty_load, moe_modules, take_expert_load
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.compiled_decode import CompiledDecode
from deltamoe.serve.engine.forks import sample_first_tokens, with_fork_picks
from deltamoe.serve.engine.prompt_logprobs import (PromptScoring, chunk_prompt_logprobs, score_chunk,
                                                   wants_prompt_logprobs)
from deltamoe.serve.engine.image_inputs import CallImages, call_images, encode_pending
from deltamoe.serve.engine.sampling import TokenLogprob, sample
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence


@dataclass(slots=True)
class ModelCall:
    """One model call as host data: everything a rank needs to run it on its shard of model and cache."""

    token_ids: list[int]  # row-major [B, T], rows right-padded with token 0 to T = max(counts)
    block_tables: list[list[int]]
    past_lengths: list[int]
    slots: list[int]
    counts: list[int]  # real new tokens per row
    compiled: bool  # through the compiled decode graph
    images: CallImages | None = None  # image embeddings for the placeholders this call covers

    @classmethod
    def of(cls, group: list[tuple[Sequence, int]], compiled_decode: bool) -> "ModelCall":
        seqs, counts = [seq for seq, _ in group], [n for _, n in group]
        t = max(counts)
        if t == 1:  # decode: one flat list (a list of lists costs ~0.5 us more per row)
            ids = [s.token_ids[s.num_computed] for s in seqs]
        else:
            ids = [tok for s, n in zip(seqs, counts) for tok in s.token_ids[s.num_computed:s.num_computed + n] + [0] * (t - n)]
        # A T = 1 call where every row starts empty is the prefill of one-token prompts: eager, like
        # every prefill (compiled, its context of one token would be a graph of its own).
        images = call_images(group) if any(s.images is not None for s in seqs) else None
        compiled = compiled_decode and t == 1 and any(s.num_computed for s in seqs) and images is None
        return cls(ids, [s.block_table for s in seqs], [s.num_computed for s in seqs], [s.slot for s in seqs],
                   counts, compiled, images)


@dataclass(slots=True)
class StepResult:
    seq: Sequence
    num_computed: int  # tokens computed this step
    token: int | None  # the sampled next token, when the chunk reached the end of the sequence
    logprob: TokenLogprob | None
    forks: list[tuple[int, TokenLogprob | None]] | None = None  # first tokens of the choices forking it (forks.py)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens this step scored (prompt_logprobs.py)


class ModelRunner:
    def __init__(self, model: DeltaMoEForCausalLM, cache: HybridCache, compiled_decode: bool = False,
                 compile_form: str = "layers"):
        self.model = model
        self.cache = cache
        self.device = model.device
        # Decode calls (T = 1) through the compiled regions; prefill chunks always run eagerly.
        self._compiled_decode = CompiledDecode(model, compile_form) if compiled_decode else None
        # Tokens routed to each expert [MoE layers, experts], summed over calls: kept when asked
        # (`track_expert_load`), for the per-rank expert load a multi-worker server reports.
        self.expert_load: torch.Tensor | None = None
        self._moe_rows: dict[int, MoE] = {}

    def track_expert_load(self) -> None:
        moes = moe_modules(self.model)
        self._moe_rows = dict(enumerate(moes))
        self.expert_load = empty_load(len(moes), self.model.config.num_experts)

    @property
    def compiles_decode(self) -> bool:
        return self._compiled_decode is not None

    def plan(self, batch: ScheduledBatch) -> list[tuple[list[tuple[Sequence, int]], ModelCall]]:
        """The step's model calls (the decodes, T = 1, first), each with the items it computes."""
        compiled = self._compiled_decode
        return [(group, ModelCall.of(group, compiled is not None and compiled.runs(group)))
                for group in pack_calls(batch.items)]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        encode_pending(self.model, batch.items)  # before planning: the calls carry the image embeddings
        return self.run(batch, self.plan(batch))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, calls: list[tuple[list[tuple[Sequence, int]], ModelCall]]) -> list[StepResult]:
        """Run the planned calls and sample every row that reaches the end of its tokens."""
        last_logits: list[torch.Tensor] = []
        to_sample: list[Sequence] = []
        scored: dict[int, list[TokenLogprob]] = {}  # prompt logprobs of this step, by sequence
        for group, call in calls:
            seqs = [seq for seq, _ in group]
            scoring = [row for row, (seq, _) in enumerate(group) if wants_prompt_logprobs(seq)]
            if scoring and max(call.counts) > 1:
                logits, hidden = self.forward(call, with_hidden=True)
            else:
                logits, hidden = self.forward(call), None
            for row in scoring:
                seq, n = group[row]
                scored[id(seq)] = chunk_prompt_logprobs(self.model, seq, n, None if hidden is None else hidden[row, :n],
                                                        logits[row])
            rows = [row for row, (seq, n) in enumerate(group) if seq.num_computed + n == len(seq.token_ids)]
            if rows:  # one gather per call, not one select per row
                last_logits.append(logits if len(rows) == len(seqs) else logits[rows])
                to_sample.extend(seqs[row] for row in rows)
        for seq, n in batch.items:
            if seq.images is not None:
                seq.images.release_before(seq.num_computed + n)
        if scored:
            return with_prompt_logprobs(self.sample_rows(batch, last_logits, to_sample), scored)
        return self.sample_rows(batch, last_logits, to_sample)

    def sample_rows(self, batch: ScheduledBatch, last_logits: list[torch.Tensor], to_sample: list[Sequence]
                    ) -> list[StepResult]:
        """The step's results: a token drawn for each row of `to_sample` from its logits in `last_logits`
        (in order), the other rows of `batch` (prefill chunks that end before the prompt does) without one."""
        if not to_sample:
            return [StepResult(seq, n, None, None) for seq, n in batch.items]
        logits = last_logits[0] if len(last_logits) == 1 else torch.cat(last_logits)
        allowed = [s.grammar.allowed() if s.grammar is not None else None for s in to_sample]
        picks = sample(logits, [s.params for s in to_sample], [penalised_outputs(s) for s in to_sample],
                       [s.generator for s in to_sample], allowed)
        if any(s.forks for s in to_sample):
            return with_fork_picks(batch, to_sample, picks, sample_first_tokens(logits, to_sample))
        if len(to_sample) == len(batch.items) and all(a is b for a, (b, _) in zip(to_sample, batch.items)):
            # Every row sampled, in schedule order (a pure decode step): no lookup by sequence.
            return [StepResult(seq, n, *pick) for (seq, n), pick in zip(batch.items, picks)]
        sampled = {id(s): p for s, p in zip(to_sample, picks)}
        return [StepResult(seq, n, *sampled.get(id(seq), (None, None))) for seq, n in batch.items]

    @torch.inference_mode()
    def last_logits(self, calls: list[tuple[list[tuple[Sequence, int]], ModelCall]], rows: list[list[int]],
                    inputs: list[torch.Tensor | None] | None = None,
                    scorings: list[list[tuple[Sequence, PromptScoring]]] | None = None
                    ) -> tuple[torch.Tensor | None, list[Sequence], list[tuple[Sequence, int, list[TokenLogprob]]]]:
        """Run the calls -> the last-token logits of rows `rows[i]` of call i, stacked [N, V], their
        sequences (None, [] when no row is sampled), and the prompt logprobs `scorings[i]` (planned
        before the step, `prompt_logprobs.call_scorings`) asks of call i, as (seq, first position,
        entries). `inputs[i]`: call i's token ids as a tensor, when they are not all on the host
        (`executor/overlap.py`)."""
        parts: list[torch.Tensor] = []
        to_sample: list[Sequence] = []
        scored: list[tuple[Sequence, int, list[TokenLogprob]]] = []
        for i, ((group, call), picked) in enumerate(zip(calls, rows)):
            ids = None if inputs is None else inputs[i]
            scoring = scorings[i] if scorings else []
            hidden = None
            if any(sc.hidden_rows is not None for _, sc in scoring):
                logits, hidden = self.forward(call, ids, with_hidden=True)
            else:
                logits = self.forward(call, ids)
            for seq, sc in scoring:
                scored.append((seq, sc.first, score_chunk(self.model, sc, None if sc.hidden_rows is None
                                                          else hidden[sc.row], logits[sc.row])))
            if picked:  # one gather per call, not one select per row
                parts.append(logits if len(picked) == len(group) else logits[picked])
                to_sample.extend(group[row][0] for row in picked)
        if not parts:
            return None, [], scored
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), to_sample, scored

    def batch_view(self, call: ModelCall) -> PagedBatchView:
        """The cache view a forward of `call` reads and writes (over the rows the compiled call runs:
        `CompiledDecode.with_min_rows`)."""
        compiled = self._compiled_decode if call.compiled else None
        if compiled is not None:
            call = compiled.with_min_rows(call)[0]
        return PagedBatchView(self.cache, call.block_tables, call.past_lengths, call.slots, call.counts,
                              min_table_width=compiled.min_table_width if compiled is not None else 1,
                              slice_consecutive=compiled is None or compiled.slices_consecutive_pages)

    @torch.inference_mode()
    def forward(self, call: ModelCall, ids: torch.Tensor | None = None, with_hidden: bool = False,
                view: PagedBatchView | None = None):
        """One model call appending counts[i] tokens to row i (right-padded to the longest with token
        0, which the cache view keeps out of every state) -> each row's last-token logits [B, V] fp32
        (`with_hidden`: and the hidden states [B, T, D], for prompt logprobs and the speculative MTP
        catch-up; compiled calls in the regional forms only, `CompiledDecode.with_hidden_states`).
        `ids`: the call's token ids [B, T] already on the device (default: from `call.token_ids`).
        `view`: the call's cache view when the caller holds it (`batch_view`, or a multi-step
        window's `PagedBatchView.next_decode_view`); default: built from the call."""
        if ids is None:
            ids = torch.tensor(call.token_ids, device=self.device).view(len(call.counts), -1)
        compiled = self._compiled_decode if call.compiled else None
        rows = len(call.counts)
        if view is None:
            view = self.batch_view(call)
        if compiled is not None:
            call, ids = compiled.with_min_rows(call, ids)
        # Norm + LM head on the last real position only: prefill chunks need no other logits.
        if compiled is not None and with_hidden:  # regional forms only (speculative MTP catch-up)
            logits, hidden = compiled.with_hidden_states(ids, view)
            logits, hidden = logits[:rows, -1].float(), hidden[:rows]
        elif compiled is not None:
            logits = compiled(ids, view)[:rows, -1].float()
        else:
            embeds = None if call.images is None else self.model.embed(
                ids, call.images.embeds, call.images.mask(*ids.shape, ids.device))
            out = self.model(ids, cache=view, logits_to_keep=1, inputs_embeds=embeds)
            logits, hidden = out.logits[:, -1].float(), out.hidden_states
        if self.expert_load is not None:
            take_expert_load(self._moe_rows, self.expert_load)
        return (logits, hidden) if with_hidden else logits


def penalised_outputs(seq: Sequence) -> list[int]:
    """The output ids sampling reads for `seq`: only presence/frequency penalties read them, so a row
    without penalties passes none instead of a copy of its whole output each step."""
    p = seq.params
    return seq.output_ids if p.presence_penalty or p.frequency_penalty else []


def with_prompt_logprobs(results: list[StepResult], scored: dict[int, list[TokenLogprob]]) -> list[StepResult]:
    for r in results:
        r.prompt_logprobs = scored.get(id(r.seq))
    return results


def sampled_rows(group: list[tuple[Sequence, int]]) -> list[int]:
    """The rows of a call whose chunk reaches the end of the sequence's tokens: they are sampled."""
    return [row for row, (seq, n) in enumerate(group) if seq.num_computed + n == len(seq.token_ids)]


# Prefill chunks of different lengths share a call while padding stays within this share of the
# real tokens; each call costs a fixed ~600 small tensor ops, so fewer, padded calls win on a CPU.
MAX_PADDING_FRACTION = 0.5


def pack_calls(items: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """Split a step's (sequence, new tokens) items into model calls: all decodes in one call, and
    prefill chunks longest first, each call right-padded to its longest chunk as long as the
    padding stays under MAX_PADDING_FRACTION of its real tokens."""
    decodes = [item for item in items if item[1] == 1]
    calls: list[list[tuple[Sequence, int]]] = [decodes] if decodes else []
    current: list[tuple[Sequence, int]] = []
    real = 0
    for item in sorted((item for item in items if item[1] > 1), key=lambda item: -item[1]):
        longest = current[0][1] if current else item[1]
        if current and (len(current) + 1) * longest - (real + item[1]) > MAX_PADDING_FRACTION * (real + item[1]):
            calls.append(current)
            current, real = [], 0
        current.append(item)
        real += item[1]
    if current:
        calls.append(current)
    return calls
