"""Image embeddings of a step, from rank 0 to every rank of a tp * ep replica.

The vision tower is whole on every rank (the serving plans shard decoder layers, not the tower),
but only rank 0 runs it: it holds the requests and their pixels, encodes each image once
(`image_inputs.encode_pending`), and the rows a step's calls splice into their input embeddings
travel to the other ranks as one tensor broadcast after the step's message, not pickled inside it
(a CUDA tensor in a pickle would come back on rank 0's device index). The message carries each
call's placeholder positions and row count, so every rank embeds exactly what rank 0 does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deltamoe.serve.engine.image_inputs import CallImages
from deltamoe.serve.engine.runner import ModelCall


@dataclass
class StepImages:
    """What the ranks need to receive a step's image rows: rows per call (0: none), width, dtype."""

    rows: list[int]
    width: int
    dtype: str  # e.g. "bfloat16"


def split_off_images(calls: list[ModelCall]) -> tuple[list[ModelCall], StepImages | None, torch.Tensor | None]:
    """The calls as the ranks get them (image rows taken out; the calls rank 0 runs are not touched),
    what describes those rows, and the rows themselves [sum of rows, D] to broadcast."""
    if all(call.images is None for call in calls):
        return calls, None, None
    sent, rows, parts = [], [], []
    for call in calls:
        if call.images is None:
            sent.append(call)
            rows.append(0)
            continue
        sent.append(dataclasses.replace(call, images=CallImages(call.images.positions, torch.empty(0))))
        rows.append(len(call.images.embeds))
        parts.append(call.images.embeds)
    embeds = torch.cat(parts).contiguous()
    return sent, StepImages(rows, embeds.shape[1], str(embeds.dtype).removeprefix("torch.")), embeds


def empty_rows(images: StepImages, device: torch.device | str) -> torch.Tensor:
    """The buffer a rank > 0 receives the step's image rows into."""
    return torch.empty(sum(images.rows), images.width, dtype=getattr(torch, images.dtype), device=device)


def attach_images(calls: list[ModelCall], images: StepImages, embeds: torch.Tensor) -> None:
    """Give each call its image rows back (on a rank > 0, after the broadcast)."""
    start = 0
    for call, n in zip(calls, images.rows):
        if n:
            call.images = CallImages(call.images.positions, embeds[start:start + n])
            start += n
