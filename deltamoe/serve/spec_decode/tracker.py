"""Per-request speculation state and the acceptance statistics /metrics and `generate` report.

A request speculates until its drafts keep failing: once the last `WINDOW` verifications kept
fewer than `min_acceptance` of their drafts, it decodes plainly (the drafts cost an MTP pass and
K extra positions per step, worth it only when enough of them land). After `RETRY_AFTER` plain
tokens it tries again (what it writes may have turned predictable), over a fresh window; each
switch-off doubles the wait, so a request whose drafts never land spends a shrinking share of
its steps on them. Trying again needs the MTP layer current over the plain tokens: the runner
keeps it so where its plain calls hand back hidden states (every form but the whole-call
graph); there a switch-off is for good.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltamoe.serve.engine.sequence import Sequence

if TYPE_CHECKING:
    from deltamoe.serve.spec_decode.batch_rule import PendingCatchUp

WINDOW = 8  # verifications a request's acceptance is judged over
RETRY_AFTER = 64  # plain tokens after a first switch-off before speculating again (doubled per switch-off)


@dataclass
class Drafts:
    position: int  # the sequence's computed length they were drafted at (its pending token sits there)
    tokens: list[int]
    probs: torch.Tensor | None  # [K, V] the distributions they were drawn from (sampling requests)


@dataclass
class RequestSpeculation:
    on: bool = True
    drafts: Drafts | None = None
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))  # kept drafts per verification
    pending: PendingCatchUp | None = None  # positions plain steps computed that the MTP layer has yet to read
    times_off: int = 0  # switch-offs so far
    plain_tokens: int = 0  # tokens decoded plainly since the last switch-off


class AcceptanceTracker:
    def __init__(self, num_draft_tokens: int, min_acceptance: float):
        self.k = num_draft_tokens
        self.min_acceptance = min_acceptance
        self._requests: weakref.WeakKeyDictionary[Sequence, RequestSpeculation] = weakref.WeakKeyDictionary()
        self.verifications = 0
        self.accepted_at = [0] * num_draft_tokens  # verifications that kept draft j (j = 0 .. K-1)
        self.switched_off = 0
        self.plain_by_rule_steps = 0  # steps run as plain decode by the batch-size limit (batch_rule.py)
        self.plain_by_cost_steps = 0  # steps below the limit run plainly because speculation cost more there
        self.retries = 0  # switched-off requests that speculated again after their wait

    def state(self, seq: Sequence) -> RequestSpeculation:
        state = self._requests.get(seq)
        if state is None:
            state = self._requests[seq] = RequestSpeculation()
        return state

    def speculates(self, seq: Sequence) -> bool:
        # A grammar or a logit_bias decodes plainly: verification does not apply them to its targets yet,
        # and a request's output must not depend on whether it speculated.
        if seq.grammar is not None or seq.params.logit_bias:
            return False
        state = self._requests.get(seq)
        return state is None or state.on

    def record(self, seq: Sequence, accepted: int) -> None:
        """One verification of `seq` kept `accepted` of its K drafts."""
        self.verifications += 1
        for j in range(accepted):
            self.accepted_at[j] += 1
        state = self.state(seq)
        state.recent.append(accepted)
        if len(state.recent) == WINDOW and sum(state.recent) < self.min_acceptance * WINDOW * self.k:
            state.on, state.drafts, state.plain_tokens = False, None, 0
            state.times_off += 1
            self.switched_off += 1

    def count_plain(self, seq: Sequence, tokens: int) -> None:
        """A switched-off request decoded `tokens` more plainly (its MTP layer kept current): after
        RETRY_AFTER * 2^(switch-offs - 1) of them it speculates again, judged over a fresh window."""
        state = self.state(seq)
        if state.times_off == 0:  # never switched off (it decodes plainly for its grammar or logit_bias)
            return
        state.plain_tokens += tokens
        if state.plain_tokens >= RETRY_AFTER << (state.times_off - 1):
            state.on = True
            state.recent.clear()
            self.retries += 1

    def tokens_per_verification(self, seqs: list[Sequence]) -> float | None:
        """What a verification of these rows is expected to emit per row: the pending token plus the
        drafts kept, from each row's recent verifications where it has some, else from every
        verification so far (None before the first)."""
        overall = 1 + sum(self.acceptance_rates()) if self.verifications else None
        per_row = []
        for seq in seqs:
            state = self._requests.get(seq)
            if state is not None and state.recent:
                per_row.append(1 + sum(state.recent) / len(state.recent))
            elif overall is not None:
                per_row.append(overall)
        return sum(per_row) / len(per_row) if per_row else None

    def acceptance_rates(self) -> list[float]:
        """Per draft position: the share of verifications that kept it."""
        return [n / self.verifications if self.verifications else 0.0 for n in self.accepted_at]

    COUNTERS = frozenset({"spec_decode_verifications", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                          "spec_decode_requests_switched_off", "spec_decode_plain_by_rule_steps",
                          "spec_decode_plain_by_cost_steps", "spec_decode_requests_retried"})  # running totals in `stats`

    def stats(self) -> dict[str, float]:
        rates = self.acceptance_rates()
        out = {f"spec_decode_acceptance_rate_position_{j + 1}": r for j, r in enumerate(rates)}
        out.update(spec_decode_verifications=float(self.verifications),
                   spec_decode_draft_tokens=float(self.verifications * self.k),
                   spec_decode_accepted_tokens=float(sum(self.accepted_at)),
                   spec_decode_mean_accepted_drafts=sum(rates),
                   spec_decode_requests_switched_off=float(self.switched_off),
                   spec_decode_plain_by_rule_steps=float(self.plain_by_rule_steps),
                   spec_decode_plain_by_cost_steps=float(self.plain_by_cost_steps),
                   spec_decode_requests_retried=float(self.retries))
        return out


def summary_line(tracker: AcceptanceTracker) -> str:
    """One line for `deltamoe generate`: acceptance per draft position and what it bought."""
    rates = " ".join(f"{r:.2f}" for r in tracker.acceptance_rates())
    return (f"speculative (mtp, {tracker.k} drafts): acceptance per draft position {rates}; "
            f"{sum(tracker.acceptance_rates()):.2f} drafts kept per verification over {tracker.verifications} "
            f"verifications; {tracker.switched_off} requests switched speculation off ({tracker.retries} tried again); "
            f"{tracker.plain_by_rule_steps} steps ran plain by the batch-size rule, "
            f"{tracker.plain_by_cost_steps} below it where speculation cost more")
