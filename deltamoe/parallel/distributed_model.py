"""`DistributedModel`: the ParallelModel for world > 1 (any mix of DP/FSDP2, TP, EP and PP)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule

from deltamoe.parallel.api import ParallelDims
from deltamoe.parallel.grad_norm import clip_grads_, global_grad_norm
from deltamoe.parallel.loss import GlobalTokenLoss, target_counts
from deltamoe.parallel.mesh import data_mesh
from deltamoe.parallel.stage_module import ModelStage


class DistributedModel:
    def __init__(self, stages: list[ModelStage], mesh: DeviceMesh, dims: ParallelDims, loss_fn: GlobalTokenLoss,
                 schedule: _PipelineSchedule | None, after_backward: list[Callable[[], None]]):
        self.model_parts: list[ModelStage] = stages
        self.mesh, self.dims, self.loss_fn, self.schedule = mesh, dims, loss_fn, schedule
        self.after_backward = after_backward
        dp = data_mesh(mesh)
        self.dp_group = dp.get_group()
        self.dp_rank, self.dp_size = dp.get_local_rank(), dp.size()
        self.has_first = any(s.first for s in stages)
        self.has_last = any(s.last for s in stages)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] % self.dims.microbatches != 0:
            raise ValueError(f"the local batch ({input_ids.shape[0]} rows) must divide into "
                             f"{self.dims.microbatches} microbatches")
        counts = target_counts(labels, self.loss_fn.mtp_depths)
        dist.all_reduce(counts, group=self.dp_group)
        self.loss_fn.counts = counts
        if self.schedule is not None:
            local = self._pipelined(input_ids, labels)
        else:
            local = self._accumulated(input_ids, labels)
        for hook in self.after_backward:
            hook()
        # Data ranks hold parts of the sum, only the last stage has it, tensor ranks hold copies.
        total = local.float().clone()
        dist.all_reduce(total)
        return total / self.dims.tp

    def _accumulated(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One stage: forward + backward per microbatch; FSDP reduces gradients after the last one only."""
        stage, n = self.model_parts[0], self.dims.microbatches
        total = torch.zeros((), device=labels.device)
        for i, (ids, target) in enumerate(zip(input_ids.chunk(n), labels.chunk(n))):
            if isinstance(stage, FSDPModule):
                stage.set_requires_gradient_sync(i == n - 1)
            loss = self.loss_fn(stage(ids), target)
            loss.backward()
            total = total + loss.detach()
        return total

    def _pipelined(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        target = labels if self.has_last else None
        if self.has_first:
            self.schedule.step(input_ids, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        return torch.stack(losses).sum().detach() if self.has_last else torch.zeros((), device=labels.device)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for stage in self.model_parts for p in stage.parameters()]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = self.parameters()
        norm = global_grad_norm(params, self.mesh["pp"].get_group() if self.dims.pp > 1 else None)
        clip_grads_(params, max_norm, norm)
        return norm

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=self.dp_group)
        return out

    def is_logging_rank(self) -> bool:
        return dist.get_rank() == 0
