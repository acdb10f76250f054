"""A quantized checkpoint's int4 projections split over the TP group, by the training plan's layout.

`parallel/tensor_parallel.py` plans which projection of a layer is column-parallel (output features
split: heads, MLP width) and which row-parallel (input features split, partial sums all-reduced);
it shards float Linears. An `Int4Linear` (int4 / w4a8 checkpoints) takes the same plan here, as an
`Int4LinearShard`: an Int4Linear of the local shape that slices each published tensor as it loads
(`weight_packed` int32 words of 8 nibbles along the input, `weight_scale` one column per group), so
a rank reads and converts only its rows or columns. A row-parallel split must keep whole groups and
whole words on each rank (input features / tp a multiple of the group size), else it is refused
naming the projection. W4A8-fp8 scales each activation row by its maximum over the whole row: a
row-parallel shard sees a slice, so the ranks all-reduce the rows' maxima first (one small MAX)
and quantise exactly as one process; the int8 kernel computes its row scales itself, so a
row-parallel w4a8-int8 projection is refused. Each rank's partial sum is rounded to the output
dtype before the all-reduce (as for float row-parallel Linears).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from deltamoe.errors import CheckpointError, ConfigError
from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.parallel.tensor_parallel import tp_plans


class _Format(NamedTuple):
    """The two scheme fields an Int4Linear is built from."""

    group_size: int
    activations: str | None


class Int4LinearShard(Int4Linear):
    def __init__(self, full: Int4Linear, how: str, rank: int, size: int, group: dist.ProcessGroup, name: str):
        k, n, g = full.in_features, full.out_features, full.group_size
        if how == "col" and n % size:
            raise ConfigError(f"{name}: {n} output features do not split over tp = {size}", field="tp")
        if how == "row" and full.activations == "int8":
            raise ConfigError(f"{name}: a row-parallel w4a8 int8 projection would quantise its activations per "
                              "row over a slice of each row (the int8 kernel takes no row scale)", field="tp",
                              hint="serve w4a8 int8 with --ep (tp 1), or quantize with --activations fp8")
        if how == "row" and (k % size or (k // size) % g):
            raise ConfigError(f"{name}: {k} input features over tp = {size} do not keep whole int4 groups of {g}",
                              field="tp", hint="a tp that divides in_features / group_size")
        super().__init__(k // size if how == "row" else k, n // size if how == "col" else n,
                         _Format(g, full.activations), full.use_kernel)
        self.how, self.rank, self.size, self.tp_group = how, rank, size, group
        self.full_shape = (n, k)

    def load_part(self, name: str, part: str, tensor: torch.Tensor) -> None:
        if part == "weight_shape":  # checked whole, then passed on as this rank's shape
            if tuple(tensor.tolist()) != self.full_shape:
                raise CheckpointError(f"weight_shape {tuple(tensor.tolist())}, model {self.full_shape}", field=name)
            tensor = torch.tensor([self.out_features, self.in_features], dtype=tensor.dtype)
        else:
            dim = 0 if self.how == "col" else 1  # rows of both tensors, or a range of their columns
            tensor = tensor.chunk(self.size, dim)[self.rank].contiguous()
        super().load_part(name, part, tensor)

    def row_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.how != "row":
            return None
        amax = x.float().abs().amax(-1, keepdim=True)  # this slice's; the whole rows' after the all-reduce
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
        return amax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.how == "row":
            dist.all_reduce(y, group=self.tp_group)
        return y


def shard_int4_projections(model: nn.Module, rank: int, size: int, group: dist.ProcessGroup) -> int:
    """Swap every planned Int4Linear (still unloaded) for this rank's shard; returns how many."""
    count = 0
    names = {id(m): n for n, m in model.named_modules()}
    for parent, plan in tp_plans(model):
        for child, how in plan.items():
            module = getattr(parent, child)
            if isinstance(module, Int4Linear):
                if module.is_loaded:
                    raise RuntimeError("shard_int4_projections: shard before loading (a meta-built skeleton)")
                name = f"{names[id(parent)]}.{child}"
                setattr(parent, child, Int4LinearShard(module, how, rank, size, group, name))
                count += 1
    return count
