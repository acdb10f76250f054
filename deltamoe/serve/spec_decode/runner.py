"""SpeculativeRunner: the engine's runner with MTP drafting and one-forward verification.

Per step, the scheduled items split three ways:
- requests whose speculation is off (their acceptance fell below the threshold) run as in
  `ModelRunner` (the compiled decode regions included, with `compile_decode`), keeping their
  hidden states for the MTP layer so that they can try again later (`tracker.py`);
- speculating decodes with drafts ready: one verification call for all of them, each row
  appending its pending token and its K drafts (T = K + 1), logits at every position: eager, or
  with `compile_decode` through compiled regions of its own (`compiled_verify.py`);
- other speculating items (prefill chunks, decodes without drafts: the first step after plain
  ones, no room for K more tokens, or too close to the length limit) run as `ModelRunner`'s
  calls (decodes through its compiled regions with `compile_decode`), keeping the hidden states
  the MTP catch-up needs.
Then one MTP pass catches up every speculating row and drafts for the next step (with
`compile_decode`, its calls over rows with a past through a compiled region, `compiled_draft.py`).
A step whose running batch reaches `spec_max_batch` runs as plain decode for every row instead
(`batch_rule.py`): it keeps the speculating rows' hidden states for a later MTP catch-up. So does a
smaller decode step where the measured costs say speculation does not pay (`step_costs.py`): the
runner times its decode steps under the limit for that. A step with a seeded sampling row that
speculates is the exception: timings vary run to run and the two kinds of step draw from the
request's generator differently, so there the size rule alone decides (the seed reproduces the text).

Blocks: a verifying row holds blocks for its K extra positions during the call only; after it,
blocks past its kept tokens go back to the pool, and drafting takes what its provisional MTP
positions need (none when the pool is empty: the row then decodes plainly next step).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from deltamoe.errors import ConfigError
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.compiled_decode import WarmUpCall, expert_form_budget
from deltamoe.serve.engine.config import EngineConfig, check_speculative_layout
from deltamoe.serve.engine.image_inputs import encode_pending
from deltamoe.serve.engine.runner import ModelRunner, StepResult
from deltamoe.serve.engine.sampling import token_logprobs
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.spec_decode.acceptance import accept_greedy, greedy_targets, rejection_sample, target_probs
from deltamoe.serve.spec_decode.batch_rule import PendingCatchUp, run_plain_keeping_hidden, runs_plain
from deltamoe.serve.spec_decode.checkpoint_view import CheckpointView
from deltamoe.serve.spec_decode.compiled_draft import CompiledDraft, draft_shapes
from deltamoe.serve.spec_decode.compiled_verify import CompiledVerify, verification_batches
from deltamoe.serve.spec_decode.mtp_drafter import CatchUp, MTPDrafter, following_tokens
from deltamoe.serve.spec_decode.step_costs import StepCosts
from deltamoe.serve.spec_decode.step_result import SpeculativeStepResult
from deltamoe.serve.spec_decode.tracker import AcceptanceTracker


class SpeculativeRunner(ModelRunner):
    def __init__(self, model: DeltaMoEForCausalLM, cache: HybridCache, config: EngineConfig, max_len: int):
        super().__init__(model, cache, compiled_decode=config.compile_decode, compile_form=config.compile_form)
        self.k = config.num_draft_tokens
        self.max_len = max_len  # tokens a sequence may hold (context limit and cache size)
        # With --compile the verification (T = K + 1) and the MTP layer's calls run through compiled regions too.
        decode = self._compiled_decode
        self._compiled_verify = CompiledVerify(model, decode, self.k) if decode is not None else None
        self.drafter = MTPDrafter(model, cache, self.k, CompiledDraft(model, decode) if decode is not None else None)
        self.tracker = AcceptanceTracker(self.k, config.spec_min_acceptance)
        self.max_batch = config.spec_max_batch
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.costs = StepCosts()  # plain and speculative step times by batch size, under max_batch
        self.by_cost = config.spec_max_batch > 0 and config.spec_batch_rule == "cost"
        # Plain rows hand back their hidden states (for the MTP catch-up) in every form but the whole-call graph.
        self._keeps_hidden = decode is None or decode.form != "whole"

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        # Prefill chunks over image placeholders carry the rows (`ModelCall.of`), in every path below;
        # the MTP layer reads the placeholder token's embedding there (draft quality only: the target
        # verifies every draft with the image rows).
        encode_pending(self.model, batch.items)
        try:
            return self._execute(batch)
        finally:
            for seq, n in batch.items:
                if seq.images is not None:
                    seq.images.release_before(seq.num_computed + n)

    def _execute(self, batch: ScheduledBatch) -> list[StepResult]:
        rows = len(batch.items)
        # A step of decoding rows under the limit is timed for the cost rule (`step_costs.py`).
        timed = self.by_cost and rows < self.max_batch and all(n == 1 for _, n in batch.items)
        start = time.perf_counter()
        if runs_plain(rows, self.max_batch):
            self.tracker.plain_by_rule_steps += 1  # never with the whole-call graph (EngineConfig refuses it)
            return self._execute_plain(batch)
        if timed and not self._speculation_pays(batch):
            self.tracker.plain_by_cost_steps += 1
            results = self._execute_plain(batch)
            self.costs.record(False, rows, time.perf_counter() - start)
            return results
        results, verified = self._execute_speculative(batch)
        if timed and verified == rows:
            self.costs.record(True, rows, time.perf_counter() - start)
        return results

    def _speculation_pays(self, batch: ScheduledBatch) -> bool:
        seqs = [seq for seq, _ in batch.items if self.tracker.speculates(seq)]
        # A seeded sampling row must draw the same tokens run to run, and a plain step draws from its
        # generator differently from a verification: a step holding one follows the size rule alone,
        # never timings (which vary run to run). Greedy rows emit plain decoding's tokens either way.
        if any(seq.params.seed is not None and not seq.params.greedy for seq in seqs):
            return True
        return not seqs or self.costs.speculation_pays(len(batch.items), self.tracker.tokens_per_verification(seqs))

    def _execute_speculative(self, batch: ScheduledBatch) -> tuple[list[StepResult], int]:
        """The step with drafting and verification -> its results and how many rows verified drafts."""
        results: dict[int, StepResult] = {}
        plain = [item for item in batch.items if not self.tracker.speculates(item[0])]
        speculating = [item for item in batch.items if self.tracker.speculates(item[0])]
        filled: list[CatchUp] = []
        if plain and self._keeps_hidden:  # switched-off rows keep the MTP layer current, to try again later
            plain_results, filled = self._run_plain(ScheduledBatch(plain))
            results.update((id(r.seq), r) for r in plain_results)
        elif plain:
            sub = ScheduledBatch(plain)
            results.update((id(r.seq), r) for r in self.run(sub, self.plan(sub)))
        verifying = [seq for seq, n in speculating if n == 1 and self._reserve_verification(seq)]
        chosen = {id(seq) for seq in verifying}
        catch_ups: list[CatchUp] = []
        for r, catch_up in self._run_undrafted([item for item in speculating if id(item[0]) not in chosen]):
            results[id(r.seq)] = r
            catch_ups.append(catch_up)
        for r, catch_up in self._verify(verifying):
            results[id(r.seq)] = r
            catch_ups.append(catch_up)
        catch_ups = [self._after_pending(catch_up) for catch_up in catch_ups] + filled
        for catch_up in catch_ups:  # room for the provisional MTP positions of drafts 2..K
            if catch_up.draft:
                seq, end = catch_up.seq, catch_up.start + len(catch_up.next_tokens)
                catch_up.draft = (self.tracker.speculates(seq) and end + self.k - 1 <= self.max_len
                                  and self.cache.grow(seq, end + self.k - 1))
        for catch_up, drafts in zip(catch_ups, self.drafter.run(catch_ups)):
            if self.tracker.speculates(catch_up.seq):
                self.tracker.state(catch_up.seq).drafts = drafts
        return [results[id(seq)] for seq, _ in batch.items], len(verifying)

    def _execute_plain(self, batch: ScheduledBatch) -> list[StepResult]:
        """A step the batch rule runs plainly: plain decode for every row."""
        results, filled = self._run_plain(batch)
        self.drafter.run(filled)
        return results

    def _run_plain(self, batch: ScheduledBatch) -> tuple[list[StepResult], list[CatchUp]]:
        """Plain decode for the batch's rows; each row's hidden states wait for the MTP layer
        (`PendingCatchUp`) until it drafts again or a block of them fills -> the results and the
        catch-ups of the rows whose block filled (the caller runs them, drafting nothing). A
        switched-off row's plain tokens count toward trying speculation again (`tracker.count_plain`)."""
        results, hidden = run_plain_keeping_hidden(self, batch)
        block_size = self.cache.block_size
        filled: list[CatchUp] = []
        for r in results:
            seq, n = r.seq, r.num_computed
            if not self.tracker.speculates(seq):
                self.tracker.count_plain(seq, int(r.token is not None))
            state, start = self.tracker.state(seq), seq.num_computed
            state.drafts = None  # made for a position this step computes plainly
            if (start + n) // block_size > start // block_size:  # a block fills: its MTP latents before it is published
                row = CatchUp(seq, start, hidden[id(seq)], following_tokens(seq, n, r.token), draft=False)
                filled.append(self._after_pending(row))
                continue
            if state.pending is None or state.pending.end != start:
                state.pending = PendingCatchUp(start)
            state.pending.add(hidden[id(seq)])
        return results, filled

    def _after_pending(self, catch_up: CatchUp) -> CatchUp:
        """`catch_up` with the row's pending positions first, when they end where it starts (a
        preempted row computes again from an earlier position: its pending states are dropped)."""
        state = self.tracker.state(catch_up.seq)
        pending, state.pending = state.pending, None
        return pending.before(catch_up) if pending is not None and pending.end == catch_up.start else catch_up

    def _reserve_verification(self, seq: Sequence) -> bool:
        """Whether `seq` verifies drafts this step: drafts made for exactly this position, room for
        them, and blocks for its K extra positions (taken here)."""
        drafts = self.tracker.state(seq).drafts
        n = seq.num_computed
        return (drafts is not None and drafts.position == n and len(seq.token_ids) == n + 1
                and n + self.k + 1 <= self.max_len and seq.max_tokens - seq.num_output_tokens >= 2
                and self.cache.grow(seq, n + self.k + 1))

    def _run_undrafted(self, items: list[tuple[Sequence, int]]) -> list[tuple[StepResult, CatchUp]]:
        """Speculating rows that verify nothing this step (prefill chunks, decodes without drafts):
        ModelRunner's calls, decodes through the compiled regions where the engine compiles (the
        first step after plain ones is such a step for every row: eager, it cost up to twice a
        compiled one), keeping each row's hidden states for the MTP catch-up."""
        if not items:
            return []
        results, hidden = run_plain_keeping_hidden(self, ScheduledBatch(items), compiled=self._keeps_hidden)
        return [(r, CatchUp(r.seq, r.seq.num_computed, hidden[id(r.seq)],
                            following_tokens(r.seq, r.num_computed, r.token), draft=r.token is not None))
                for r in results]

    def _verify(self, seqs: list[Sequence]) -> list[tuple[StepResult, CatchUp]]:
        """One call over each row's pending token and drafts; keep what the target agrees with."""
        if not seqs:
            return []
        k = self.k
        drafts = [self.tracker.state(seq).drafts for seq in seqs]
        ids = torch.tensor([[seq.token_ids[-1]] + d.tokens for seq, d in zip(seqs, drafts)], device=self.device)
        view = self._verification_view(seqs)
        logits, hidden = self.verify_forward(ids, view)
        out: list[tuple[StepResult, CatchUp]] = []
        for b, (seq, d) in enumerate(zip(seqs, drafts)):
            p = seq.params
            if p.greedy:
                tokens = accept_greedy(greedy_targets(logits[b], p, seq.output_ids, d.tokens), d.tokens)
            else:
                tokens = rejection_sample(target_probs(logits[b], p, seq.output_ids, d.tokens), d.probs, d.tokens,
                                          seq.generator)
            accepted = len(tokens) - 1
            self.tracker.record(seq, accepted)
            logprobs = ([token_logprobs(logits[b, j], t, p.logprobs) for j, t in enumerate(tokens)]
                        if p.logprobs is not None else [None] * len(tokens))
            n = seq.num_computed
            self.cache.release_tail(seq, n + accepted + 2)  # the kept tokens and the new pending one
            result = SpeculativeStepResult(seq, accepted + 1, tokens[0], logprobs[0], tokens=tokens, logprobs=logprobs,
                                           restore=lambda j, row=b: view.restore(row, j),
                                           block_size=self.cache.block_size, num_drafts=k)
            out.append((result, CatchUp(seq, n, hidden[b, :accepted + 1], tokens, draft=True)))
        return out

    def _verification_view(self, seqs: list[Sequence]) -> CheckpointView:
        """The cache view of a verification over `seqs`: K + 1 new positions each."""
        compiled = self._compiled_verify
        return CheckpointView(self.cache, [s.block_table for s in seqs], [s.num_computed for s in seqs],
                              [s.slot for s in seqs], self.k + 1, slice_consecutive=compiled is None,
                              min_table_width=1 if compiled is None else compiled.min_table_width)

    @torch.inference_mode()
    def warm_up_call(self, call: WarmUpCall, new_sequence: Callable[[str], Sequence]) -> None:
        """Run `call` (`verification_warm_up_rounds`) through the call site traffic uses (a
        verification's `verify_forward`, the drafter's MTP call) over `call.rows` made-up sequences
        from `new_sequence(name)`, each with a past of one token; their blocks and slots are given
        back after. Without room for them in the cache it runs nothing: traffic cannot make that
        call either."""
        past, seqs = 1, []
        try:
            for i in range(call.rows):
                seq = new_sequence(str(i))
                if not self.cache.admit(seq):
                    return
                seqs.append(seq)
                if not self.cache.grow(seq, past + call.positions):
                    return
                seq.num_computed = past
            ids = torch.ones(call.rows, call.positions, dtype=torch.long, device=self.device)
            if call.kind == "verification":
                self.verify_forward(ids, self._verification_view(seqs))
            else:  # the trunk's hidden states: any values of their shape and dtype (the embeddings')
                hidden = torch.zeros_like(self.drafter.embed(ids))
                self.drafter.call(hidden, ids, seqs, [past] * call.rows, [call.positions] * call.rows)
        finally:
            for seq in seqs:
                self.cache.free(seq)

    def verify_forward(self, ids: torch.Tensor, view: CheckpointView) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over each row's pending token and drafts, ids [B, K+1] -> logits [B, K+1, V] fp32
        and hidden states [B, K+1, D]."""
        if self._compiled_verify is not None:
            return self._compiled_verify(ids, view)
        forward = self.model(ids, cache=view, logits_to_keep=self.k + 1)
        return forward.logits.float(), forward.hidden_states


def speculative_runner(model: DeltaMoEForCausalLM, cache: HybridCache, config: EngineConfig, max_len: int,
                       distributed: bool, connector: object | None) -> SpeculativeRunner:
    """The runner for `config.speculative`, after checking the combination is supported."""
    if not model.model.mtp_layers:
        raise ConfigError("the model has no MTP layers to draft with (num_nextn_predict_layers = 0)",
                          field="speculative")
    check_speculative_layout(config.speculative, distributed, connector is not None)
    return SpeculativeRunner(model, cache, config, max_len)


def speculation_stats(runner: ModelRunner) -> dict[str, float]:
    """Acceptance statistics and the measured step costs for /metrics (empty without speculation)."""
    return {**runner.tracker.stats(), **runner.costs.table()} if isinstance(runner, SpeculativeRunner) else {}


def speculation_counters(runner: ModelRunner) -> frozenset[str]:
    """The names in `speculation_stats` that are running totals."""
    return runner.tracker.COUNTERS if isinstance(runner, SpeculativeRunner) else frozenset()


def verification_warm_up_rounds(runner: ModelRunner, max_context: int) -> list[WarmUpCall]:
    """The calls that compile every graph class of the compiled speculative regions
    (`compiled_verify.py`, `compiled_draft.py`) before traffic, for `LLMEngine.warm_up` (none
    without them): one call per class, made directly (`SpeculativeRunner.warm_up_call`), since what
    the drafts keep decides the shapes traffic makes and no made-up request steers that.
    - verifications: batches of 1 .. the largest that speculates (`spec_max_batch` - 1, or
      `max_num_seqs` with no limit), K + 1 positions a row (`compiled_verify.verification_batches`);
    - the MTP layer's calls (`compiled_draft.draft_shapes`): up to `max_num_seqs` rows (a plain
      step catches up every row whose block filled), each of up to the positions one catch-up
      holds: those a row's plain steps left pending (at most a block's but one, since a filling
      block catches up) and the step's own (its verified tokens, or its share of the step's token
      budget), within the context limit.
    `max_context`: the longest sequence the engine admits (prompt + output)."""
    if not isinstance(runner, SpeculativeRunner) or runner._compiled_verify is None:
        return []
    config, k, past = runner.model.config, runner.k, 1
    budget = expert_form_budget(runner.model)
    rows = runner.max_num_seqs
    verifying = rows if runner.max_batch == 0 else min(rows, runner.max_batch - 1)
    calls = []
    if past + k + 1 <= max_context:
        calls += [WarmUpCall(f"verification, batch {b}", "verification", b, k + 1)
                  for b in verification_batches(config, k, verifying, budget)]

    def longest_catch_up(b: int) -> int:
        pending = runner.cache.block_size - 1
        return min(max_context - past, pending + max(k + 1, runner.max_num_batched_tokens // b))

    calls += [WarmUpCall(f"MTP call, {b} rows x {t} positions", "draft", b, t)
              for b, t in draft_shapes(config, rows, longest_catch_up, budget)]
    return calls


def acceptance_restorer(runner: ModelRunner) -> Callable[[], None]:
    """A callable that puts the acceptance statistics and the measured step costs back as they are
    now (after a warm-up). Until then steps are timed into a scratch table: a warm-up's steps
    include the compiles, which would misstate what a step costs."""
    if not isinstance(runner, SpeculativeRunner):
        return lambda: None
    tracker = runner.tracker
    saved = (tracker.verifications, list(tracker.accepted_at), tracker.switched_off, tracker.plain_by_rule_steps,
             tracker.retries, tracker.plain_by_cost_steps)
    costs, runner.costs = runner.costs, StepCosts()

    def restore() -> None:
        tracker.verifications, tracker.accepted_at, tracker.switched_off = saved[0], list(saved[1]), saved[2]
        tracker.plain_by_rule_steps, tracker.retries, tracker.plain_by_cost_steps = saved[3], saved[4], saved[5]
        runner.costs = costs

    return restore
