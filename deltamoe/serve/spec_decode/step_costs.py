"""What a decode step costs at each batch size, plain and speculative, as the engine measures it,
and the decision the batch rule takes from it (`batch_rule.py`).

A speculative step emits, per row, the pending token plus the drafts it keeps; a plain step one
token. So at batch B speculation pays when

    tokens per verification x (plain step's seconds at B) > (speculative step's seconds at B)

The seconds are the wall time of `SpeculativeRunner.execute` for steps of B decoding rows: a
plain step (every row plain, the MTP catch-up of filled blocks included) or a speculative one
(every row verifying, the MTP layer's catch-up and drafting included), the median of the last
`SAMPLES` of each, so a compile or a stall on a busy machine moves no decision. Steps of other
shapes (prefill chunks, rows without drafts yet, mixed steps) are not recorded. Tokens per
verification come from the acceptance tracker: the batch's rows' own recent verifications where
they have some (what they write decides how predictable it is), else every verification so far.

Where a cost is not measured yet the engine measures it: a batch size whose speculative step is
unknown speculates, one whose plain step is unknown (but whose speculative step is) decodes
plainly, `SAMPLES_TO_DECIDE` steps each, so each batch size costs a few steps of the
slower kind once per engine, and again every `RECHECK_AFTER` plain decisions there (the
acceptance a batch size saw last may no longer hold). Why measured, not a fixed batch limit: at batch 1 a CPU step is
bound by per-op overhead and a verification of K + 1 positions costs little more than a plain
step, while from batch 2 or 3 on it costs nearly its share of positions (`tiny`, compiled: see
docs/serving-speculative.md); where the crossover falls depends on the model, K, the machine, and the
acceptance the traffic gets, none of which a constant knows.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 16  # recent steps per (kind, batch size) whose median is the cost
SAMPLES_TO_DECIDE = 3  # steps of a kind measured at a batch size before its cost is trusted (median of 3+)
RECHECK_AFTER = 256  # plain decisions at a batch size before its speculative step is measured again


@dataclass
class StepCosts:
    """Seconds per decode step by batch size: `plain` and `speculative` (every row verifying)."""

    plain: dict[int, deque[float]] = field(default_factory=dict)
    speculative: dict[int, deque[float]] = field(default_factory=dict)
    plain_decisions: dict[int, int] = field(default_factory=dict)  # since the last recheck, by batch size

    def record(self, speculative: bool, batch: int, seconds: float) -> None:
        table = self.speculative if speculative else self.plain
        table.setdefault(batch, deque(maxlen=SAMPLES)).append(seconds)

    def cost(self, speculative: bool, batch: int) -> float | None:
        """The median of the recent steps of that kind at `batch`; None until SAMPLES_TO_DECIDE of them."""
        samples = (self.speculative if speculative else self.plain).get(batch)
        return statistics.median(samples) if samples is not None and len(samples) >= SAMPLES_TO_DECIDE else None

    def table(self) -> dict[str, float]:
        """The measured costs for /metrics, in milliseconds per step."""
        out: dict[str, float] = {}
        for kind, speculative in (("plain", False), ("speculative", True)):
            for batch in sorted(self.speculative if speculative else self.plain):
                cost = self.cost(speculative, batch)
                if cost is not None:
                    out[f"spec_decode_{kind}_step_ms_batch_{batch}"] = round(cost * 1e3, 3)
        return out

    def speculation_pays(self, batch: int, tokens_per_verification: float | None) -> bool:
        """Whether a step of `batch` decoding rows speculates: unmeasured costs are measured first
        (speculative, then plain), then the measured speculative step must cost less than the plain
        steps that emit the same tokens. `tokens_per_verification` None: nothing verified yet.
        After RECHECK_AFTER plain decisions at a batch size its speculative cost is measured again
        (and with it the acceptance: what the rows write may have turned predictable)."""
        speculative, plain = self.cost(True, batch), self.cost(False, batch)
        if speculative is None or tokens_per_verification is None:
            return True
        if plain is None or tokens_per_verification * plain <= speculative:
            self.plain_decisions[batch] = self.plain_decisions.get(batch, 0) + 1
            if self.plain_decisions[batch] >= RECHECK_AFTER:
                self.plain_decisions[batch] = 0
                self.speculative[batch].clear()
            return False
        return True
