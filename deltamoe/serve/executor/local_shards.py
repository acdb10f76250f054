"""Plain local-shard modules in place of the DTensor modules that the TP plan leaves behind.

`parallelize_module` (training's tensor-parallel plan) turns each planned Linear or Embedding into a
module whose weight is a DTensor and whose hooks redistribute its input and output. That dispatch
costs much more than the math for serving's small decode calls, and inference needs no autograd
bookkeeping. So after the plan is applied, each such module is swapped for the same computation on
its local shard with the one collective its placement implies:
- weight Shard(0) of a Linear (column-parallel): local matmul, output stays split by heads/width;
  the LM head (column-parallel over the vocabulary) all-gathers its logits;
- weight Shard(1) of a Linear (row-parallel): local matmul, then all-reduce the partial sums;
- weight Shard(0) of the Embedding (vocabulary rows): look up the ids in this rank's rows, zeros
  elsewhere, all-reduce (one non-zero term per token: exact).
Which module is which still comes only from the plan (the placements it produced).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard


class ColumnShard(nn.Module):
    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup, gather: bool):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group, self.gather = group, gather
        self.size = dist.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if not self.gather:
            return y
        parts = [torch.empty_like(y) for _ in range(self.size)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowShard(nn.Module):
    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class VocabShardEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group
        self.start = dist.get_rank(group) * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.group)
        return out


def use_local_shards(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Swap every module with a TP-sharded DTensor weight under `model` for its local-shard form."""
    swaps = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, DTensor) or not isinstance(weight.placements[0], Shard):
            continue
        local, dim = weight.to_local().detach(), weight.placements[0].dim
        if isinstance(module, nn.Embedding):
            swaps.append((name, VocabShardEmbedding(local, group)))
        elif isinstance(module, nn.Linear) and dim == 0:
            swaps.append((name, ColumnShard(local, group, gather=name == "lm_head")))
        elif isinstance(module, nn.Linear) and dim == 1:
            swaps.append((name, RowShard(local, group)))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
