"""Global gradient-norm clipping over parameters sharded by FSDP, TP and EP and split across stages."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm of all gradients of the model (fp32 scalar, the same on every rank).

    DTensor gradients are grouped by (mesh, placements): torch reduces each group's norm over its
    sharded dims and leaves replicated dims alone. Plain gradients are full and identical on every
    data/tensor rank. Stages hold disjoint parameters, so their squares add up over the pipeline.
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else (None, None)
            groups[key].append(g)
    squares = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float().cpu() ** 2
    if pp_group is not None:
        squares = squares.to(params[0].device) if params else squares
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt().cpu()


def clip_grads_(params: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
