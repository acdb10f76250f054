"""Held-out evaluation: loss, and for tasks the exact-match accuracy of each answer span.

Teacher-forced: the prediction for label position t is argmax logits[t-1] (the model's
next-token shift). An answer span is a maximal run of scored labels; it counts as correct
only when every one of its tokens is predicted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltamoe.model.model import IGNORE_INDEX, shifted_cross_entropy
from deltamoe.parallel.api import ParallelModel
from deltamoe.train.data import DataSource


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct spans, spans) for logits [B, T, V] and labels [B, T]."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    scored = target != IGNORE_INDEX
    wrong = scored & (pred != target)
    # Span ids: a new span starts at every scored position whose predecessor is unscored.
    start = scored & ~F.pad(scored, (1, 0))[:, :-1]
    span = torch.cumsum(start.flatten().long(), 0).view_as(scored) - 1  # -1 before the first span
    n = int(start.sum())
    if n == 0:
        return 0, 0
    bad = torch.zeros(n, dtype=torch.bool)
    bad.index_put_((span[wrong],), torch.ones(int(wrong.sum()), dtype=torch.bool), accumulate=True)
    return n - int(bad.sum()), n


@torch.no_grad()
def evaluate(pm: ParallelModel, data: DataSource, batch_rows: int,
             autocast: torch.autocast | None = None) -> torch.Tensor:
    """This rank's sums over its data rank's slice of the eval rows: [loss*tokens, tokens, correct, spans].

    Sums, not means, so the caller can all-reduce them across data ranks (and pipeline stages: a
    rank without the last stage gets no logits and adds zeros). Every rank runs the same number
    of forwards (sharded, expert-parallel and pipelined models need all ranks in step); rows past
    the rank's slice are run with all labels ignored.
    """
    was_training = [m.training for m in pm.model_parts]
    for m in pm.model_parts:
        m.eval()
    per_rank = -(-data.eval_rows // pm.dp_size)
    start, stop = pm.dp_rank * per_rank, min((pm.dp_rank + 1) * per_rank, data.eval_rows)
    device = next(pm.model_parts[0].parameters()).device
    sums = torch.zeros(4, dtype=torch.float64)
    for lo in range(start, start + per_rank, batch_rows):
        rows = data.rows("eval", lo, batch_rows)
        valid = (torch.arange(lo, lo + batch_rows) < stop)[:, None]
        ids, labels = rows.input_ids.to(device), torch.where(valid, rows.labels, IGNORE_INDEX).to(device)
        with autocast or torch.autocast(device.type, enabled=False):
            logits = pm.eval_logits(ids)
        if logits is None:  # a pipeline rank without the last stage
            continue
        tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
        if tokens:
            sums[0] += shifted_cross_entropy(logits, labels, shift=1).double().item() * tokens
            sums[1] += tokens
        if data.scores_answers:
            correct, spans = answer_accuracy(logits.float(), labels)
            sums[2] += correct
            sums[3] += spans
    for m, mode in zip(pm.model_parts, was_training):
        m.train(mode)
    return sums


def summarize(sums: torch.Tensor, scores_answers: bool) -> dict[str, float | None]:
    loss_sum, tokens, correct, spans = sums.tolist()
    return {"loss": loss_sum / tokens if tokens else None,
            "accuracy": correct / spans if scores_answers and spans else None,
            "answers": int(spans) if scores_answers else None}
