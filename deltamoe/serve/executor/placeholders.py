"""Placeholder inputs of one-step-ahead steps: token ids a step takes before the host has seen them.

With async scheduling (`overlap.py`) a decode row of step N+1 is planned while step N still samples
that row's input token: the planned `ModelCall.token_ids` hold `PLACEHOLDER` there, and a `Fill`
says which of step N's sampled rows goes in each such position. Rank 0 fills them from its sampled
ids on the device; the worker ranks of a tp * ep replica get the same ids from rank 0 (a tensor
broadcast, `MultiprocExecutor`) and fill them with the same function, so every rank runs the same
inputs without any host reading them first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.serve.engine.runner import ModelCall

PLACEHOLDER = -1  # a token a step in flight has yet to sample


@dataclass
class Fill:
    """Placeholders of one call's inputs: flat input positions <- rows of the previous step's sampled ids."""

    positions: list[int]
    rows: list[int]


def filled_inputs(calls: list[ModelCall], fills: list[Fill | None], earlier: torch.Tensor,
                  device: torch.device | str) -> list[torch.Tensor | None]:
    """Per call: its token ids [B, T] on `device` with the placeholders taken from `earlier` (the
    previous step's sampled ids), or None for a call without placeholders (its host ids are whole)."""
    inputs: list[torch.Tensor | None] = []
    for call, fill in zip(calls, fills):
        if fill is None:
            inputs.append(None)
            continue
        ids = torch.tensor(call.token_ids, device=device)
        ids[torch.tensor(fill.positions, device=device)] = earlier[torch.tensor(fill.rows, device=device)]
        inputs.append(ids.view(len(call.counts), -1))
    return inputs
