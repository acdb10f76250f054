"""New weights reaching every rank of a replica: the message rank 0 broadcasts, and how a rank keeps its part.

A weight update arrives at rank 0 as full tensors under the model's own names (`model.state_dict()`
keys, the trainer's names). Rank 0 broadcasts them in a `WeightsMessage` between two steps, and
every rank (rank 0 included) copies its part into its shard in place, so compiled graphs, the
cache and the modules the TP/EP plans built stay as they are. Which part a rank holds follows
from the tensor it already has, not from a second copy of the plans:
- an expert-parallel DTensor (Shard(d) over the EP mesh): its chunk along d at its EP coordinate;
- a plain tensor of the full shape (replicated: norms, router, low-rank projections): all of it;
- a plain tensor smaller along one dimension (TP column/row/vocabulary shards, which the plan
  splits into tp contiguous chunks): the chunk at this rank's TP coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from deltamoe.model.weights import Chunk


@dataclass
class WeightsMessage:
    """Rank 0 -> every rank, between two steps: copy these full tensors into your shard."""

    tensors: dict[str, torch.Tensor]


def part_of(name: str, target: torch.Tensor, full_shape: tuple[int, ...], tp_rank: int, tp_size: int) -> Chunk | None:
    """Which piece of the full tensor (shape `full_shape`) this rank's `target` holds; None: all of it."""
    if isinstance(target, DTensor):
        placement = target.placements[0]
        if not isinstance(placement, Shard):
            return None
        mesh = target.device_mesh
        return Chunk(placement.dim, mesh.get_local_rank(), mesh.size())
    if tuple(target.shape) == tuple(full_shape):
        return None
    dims = [d for d, (a, b) in enumerate(zip(target.shape, full_shape)) if a != b]
    if len(dims) == 1 and target.dim() == len(full_shape) and full_shape[dims[0]] == target.shape[dims[0]] * tp_size:
        return Chunk(dims[0], tp_rank, tp_size)
    raise ValueError(f"{name}: this rank holds shape {tuple(target.shape)}, which is no tp = {tp_size} "
                     f"part of the full shape {tuple(full_shape)}")


def local_part(name: str, target: torch.Tensor, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The piece of `full` that this rank's `target` holds."""
    chunk = part_of(name, target, tuple(full.shape), tp_rank, tp_size)
    return full if chunk is None else chunk.of(full)


def tp_coordinate(mesh, tp_size: int) -> int:
    """This rank's place in its TP group (0 without TP)."""
    return mesh["tp"].get_local_rank() if tp_size > 1 else 0


@torch.no_grad()
def load_full_weights(model: nn.Module, tensors: dict[str, torch.Tensor], tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy each full tensor's local part into this rank's `model` (names already checked by rank 0)."""
    targets = model.state_dict(keep_vars=True)
    for name, full in tensors.items():
        target = targets[name]
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(local_part(name, target, full, tp_rank, tp_size))
