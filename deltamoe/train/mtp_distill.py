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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from deltamoe.model.model import IGNORE_INDEX, DeltaMoEForCausalLM, shifted_cross_entropy
from deltamoe.model.mtp_chain import mtp_states


@dataclass
class DistillBatch:
    input_ids: torch.Tensor  # [B, T]
    scored: torch.Tensor | None = None  # [B, T] bool: the labels (token positions) the loss counts; None: all


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


def distill_mtp(model: DeltaMoEForCausalLM, batches: Iterable[torch.Tensor | DistillBatch], depth: int,
                lr: float = 5e-4) -> list[float]:
    """One AdamW step per batch (input ids [B, T], or a DistillBatch) on the MTP layer's parameters
    only; the mean over depths 1..depth of the cross-entropy against `trunk_targets`. Returns the
    loss per step."""
    layers = model.model.mtp_layers
    if not layers:
        raise ValueError("the model has no MTP layer to distill (num_nextn_predict_layers = 0)")
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses: list[float] = []
    try:
        for batch in batches:
            if isinstance(batch, torch.Tensor):
                batch = DistillBatch(batch)
            ids = batch.input_ids
            h, labels = trunk_targets(model, ids, model.config.pad_token_id, batch.scored)
            with torch.no_grad():
                embeds = model.model.embed_tokens(ids)
            states = mtp_states(layers, h, embeds, depth)
            per_depth = [shifted_cross_entropy(layers[min(k, len(layers) - 1)].logits(s), labels[:, k + 1:], shift=1)
                         for k, s in enumerate(states)]
            loss = torch.stack(per_depth).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        optimizer.zero_grad(set_to_none=True)
    return losses
