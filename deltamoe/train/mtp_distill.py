"""Self-distillation of the MTP layer for drafting: fine-tune only the MTP layer, at depths 1..D
applied as the speculative drafter applies it (`model/mtp_chain.py`), on the trunk's own greedy
next tokens instead of the data's labels.

Why: a draft is kept when it equals what the model itself would emit, so the target that
matters is the trunk's prediction, at every position, not the data's next token where the data
is scored. On the synthetic tasks only answer bytes are scored, so an MTP layer trained with the
model learns nothing about the text the model writes around the answers (the tasks' keys and
values are random bytes: training on them directly teaches noise). The trunk stays frozen, so
the model's own output does not change; draft k of chain t is trained to predict the trunk's
argmax at position t+k given the true prefix, the token verification compares it with once
drafts 1..k-1 are kept. EAGLE and Medusa-2 train their draft heads on the target model's
outputs for the same reason.

Where the target is taken matters too: drafts are made on text the model itself writes, and on
rows of data (prompts full of random keys) the trunk's argmax is noise that teaches the MTP layer
shortcuts (echoing its input token) which never hold on the model's own text. `DistillBatch.scored`
restricts the loss to chosen positions: with the model's own greedy continuations
(`train/mtp_distill_data.py`), the positions it generated.

Since the trunk is frozen, its states and greedy labels for a row never change: a batch may carry
them (`DistillBatch.hidden` / `labels`, from `mtp_distill_data.frozen_trunk_batches`, which runs
the trunk once per row), and a step is then the MTP layer's forward and backward alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from deltamoe.model.model import IGNORE_INDEX, DeltaMoEForCausalLM, shifted_cross_entropy
from deltamoe.model.mtp_chain import mtp_states


@dataclass
class DistillBatch:
    input_ids: torch.Tensor  # [B, T]
    scored: torch.Tensor | None = None  # [B, T] bool: the labels (token positions) the loss counts; None: all
    hidden: torch.Tensor | None = None  # [B, T, D] the trunk's states, when computed ahead (frozen trunk)
    labels: torch.Tensor | None = None  # [B, T] `trunk_targets`' labels for them (`scored` already applied)


@torch.no_grad()
def trunk_targets(model: DeltaMoEForCausalLM, input_ids: torch.Tensor, pad_id: int | None,
                  scored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(trunk hidden states [B, T, D], labels [B, T] aligned with input_ids): label j is the trunk's
    argmax after tokens 0..j-1; IGNORE_INDEX at position 0, where the input is padding and, given
    `scored` [B, T] bool, where it is False."""
    h = model.model(input_ids)
    greedy = model.lm_head(model.model.norm(h)).argmax(-1)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, 1:] = greedy[:, :-1]
    if pad_id is not None:
        labels[input_ids == pad_id] = IGNORE_INDEX
    if scored is not None:
        labels[~scored] = IGNORE_INDEX
    return h, labels


def lr_at(step: int, lr: float, warmup: int, total: int | None, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then a cosine down to `min_ratio` * lr at step `total`
    (constant after the warm-up when `total` is None). `step` counts from 1."""
    scale = min(1.0, step / warmup) if warmup > 0 else 1.0
    if total is not None and step > warmup:
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        scale *= min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return lr * scale


def depth_loss(logits: torch.Tensor, labels: torch.Tensor, k: int, teacher: torch.Tensor | None = None) -> torch.Tensor:
    """Loss of draft depth k + 1 (k from 0): `logits` [B, T-k-1, V], chain i predicting token i+k+2;
    `labels` [B, T] from `trunk_targets`. With `teacher` [B, T, V] (the trunk's next-token
    probabilities, position j predicting token j+1) the cross-entropy against that distribution
    (KL to the trunk plus its entropy, a constant) at the positions `labels` scores; else against
    the greedy labels."""
    if teacher is None:
        return shifted_cross_entropy(logits, labels[:, k + 1:], shift=1)
    keep = labels[:, k + 2:] != IGNORE_INDEX
    target = teacher[:, k + 1:-1][keep]
    return -(target * torch.log_softmax(logits[:, :-1][keep].float(), dim=-1)).sum(-1).mean()


def distill_mtp(model: DeltaMoEForCausalLM, batches: Iterable[torch.Tensor | DistillBatch], depth: int,
                lr: float = 5e-4, warmup: int = 0, total_steps: int | None = None,
                on_step: Callable[[int, float], None] | None = None, soft: bool = False) -> list[float]:
    """One AdamW step per batch (input ids [B, T], or a DistillBatch) on the MTP layer's parameters
    only; the mean over depths 1..depth of the cross-entropy against `trunk_targets` (the batch's
    own `hidden`/`labels` when it carries them): the trunk's greedy tokens, or with `soft` its whole
    next-token distribution at the same positions (`depth_loss`: more signal per row where the trunk
    is unsure, the same target where it is sure). The learning rate follows `lr_at(step, lr,
    warmup, total_steps)`. `on_step(step, loss)` runs after each step (evaluation, checkpoints).
    Returns the loss per step."""
    layers = model.model.mtp_layers
    if not layers:
        raise ValueError("the model has no MTP layer to distill (num_nextn_predict_layers = 0)")
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses: list[float] = []
    try:
        for step, batch in enumerate(batches, start=1):
            if isinstance(batch, torch.Tensor):
                batch = DistillBatch(batch)
            ids = batch.input_ids
            if batch.hidden is not None and batch.labels is not None:
                h, labels = batch.hidden, batch.labels
            else:
                h, labels = trunk_targets(model, ids, model.config.pad_token_id, batch.scored)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr, warmup, total_steps)
            with torch.no_grad():
                embeds = model.model.embed_tokens(ids)
                teacher = torch.softmax(model.lm_head(model.model.norm(h)).float(), dim=-1) if soft else None
            states = mtp_states(layers, h, embeds, depth)
            per_depth = [depth_loss(layers[min(k, len(layers) - 1)].logits(s), labels, k, teacher)
                         for k, s in enumerate(states)]
            loss = torch.stack(per_depth).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        optimizer.zero_grad(set_to_none=True)
    return losses
