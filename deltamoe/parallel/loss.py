"""The training loss normalised by the global token count, so that summing it over microbatches and
data-parallel ranks gives exactly the one-process loss of the global batch:

    loss = sum CE(next token) / N + mtp_weight * mean_k( sum CE(depth k) / N_k )

with N, N_k the non-ignored targets of the whole global batch (the model's loss is the same
formula with local means). Gradients are then summed, never averaged, across ranks and microbatches.
"""

from __future__ import annotations

import torch

from deltamoe.model.model import IGNORE_INDEX, shifted_cross_entropy


def target_counts(labels: torch.Tensor, mtp_depths: int) -> torch.Tensor:
    """Non-ignored targets of the next-token loss and of each MTP depth, float [1 + depths]."""
    return torch.stack([(labels[:, 1 + k:] != IGNORE_INDEX).sum() for k in range(1 + mtp_depths)]).double()


class GlobalTokenLoss:
    """`loss_fn(logits, labels)` for a ModelStage's last-stage output; set `counts` (global) before each step.

    A pipeline schedule calls it inside `step()` and keeps only the scalar it returns (for backward), so
    each call also records its detached [next-token, MTP] terms; `take_terms(n)` hands the sum of the
    last n calls' terms to the caller, which adds them up over ranks like the loss (the schedule's first
    step also calls it once for metadata inference, before the microbatches).
    """

    def __init__(self, mtp_depths: int, mtp_weight: float):
        self.mtp_depths, self.mtp_weight = mtp_depths, mtp_weight
        self.counts: torch.Tensor | None = None
        self._terms: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.counts is not None, "set GlobalTokenLoss.counts before the step"
        t = labels.shape[1]
        depths = self.mtp_depths if logits.shape[1] > t else 0
        parts = logits.split([t - k for k in range(1 + depths)], dim=1)
        counts = self.counts.clamp(min=1).tolist()
        lm = _ce_sum(parts[0], labels) / counts[0]
        loss, mtp = lm, torch.zeros((), device=lm.device)
        for k in range(1, 1 + depths):
            ce = _ce_sum(parts[k], labels[:, k:])
            loss = loss + self.mtp_weight / depths * ce / counts[k]
            mtp = mtp + ce.detach() / counts[k] / depths
        self._terms.append(torch.stack([lm.detach(), mtp]).float())
        return loss

    def take_terms(self, calls: int) -> torch.Tensor:
        """[next-token, MTP] terms summed over the last `calls` calls (zeros if none ran here), fp32 [2];
        forgets every recorded call."""
        terms = torch.stack(self._terms[-calls:]).sum(0) if self._terms else torch.zeros(2)
        self._terms = []
        return terms


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return shifted_cross_entropy(logits, labels, shift=1, reduction="sum")

