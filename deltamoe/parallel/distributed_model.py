"""`DistributedModel`: the ParallelModel for world > 1 (any mix of DP/FSDP2, TP, EP and PP)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule

from deltamoe.model.ffn import MoE
from deltamoe.parallel.api import StepResult
from deltamoe.parallel.data_parallel import fsdp_view_warning_ignored
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.eval_forward import PipelineEvalForward, next_token_logits
from deltamoe.parallel.expert_load import empty_load
from deltamoe.parallel.grad_norm import clip_grads_, global_grad_norm
from deltamoe.parallel.loss import GlobalTokenLoss, target_counts
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.parallel.offload import OffloadStats
from deltamoe.parallel.pipeline import stage_ids
from deltamoe.parallel.stage_module import ModelStage


class DistributedModel:
    offload_stats: OffloadStats | None = None  # set by parallelize when activations are offloaded

    def __init__(self, stages: list[ModelStage], mesh: ParallelMesh, dims: ParallelDims, loss_fn: GlobalTokenLoss,
                 schedule: _PipelineSchedule | None, after_backward: list[Callable[[], None]], moe_rows: int):
        self.model_parts: list[ModelStage] = stages
        self.mesh, self.dims, self.loss_fn, self.schedule = mesh, dims, loss_fn, schedule
        self.after_backward = after_backward
        self.moe_rows = moe_rows  # MoE layers of the whole model: the rows of StepResult.expert_load
        self.moe_layers: dict[int, MoE] = {row: m for stage in stages for row, m in stage.moe_layers.items()}
        self.dp_group = mesh.dp.get_group()
        self.dp_rank, self.dp_size = mesh.dp.get_local_rank(), mesh.dp.size()
        self.has_first = any(s.first for s in stages)
        self.has_last = any(s.last for s in stages)
        self._pipeline_eval: PipelineEvalForward | None = None
        if schedule is not None:
            pp_mesh = mesh["pp"]
            self._pipeline_eval = PipelineEvalForward(stages, stage_ids(pp_mesh.get_local_rank(), dims),
                                                      dims.num_stages, dims.pp, pp_mesh.get_group())

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> StepResult:
        if input_ids.shape[0] % self.dims.microbatches != 0:
            raise ValueError(f"the local batch ({input_ids.shape[0]} rows) must divide into "
                             f"{self.dims.microbatches} microbatches")
        counts = target_counts(labels, self.loss_fn.mtp_depths)
        dist.all_reduce(counts, group=self.dp_group)
        self.loss_fn.counts = counts
        for stage in self.model_parts:
            stage.expert_loads = []
        try:
            with fsdp_view_warning_ignored():
                if self.schedule is not None:
                    local = self._pipelined(input_ids, labels)
                else:
                    local = self._accumulated(input_ids, labels)
            # Each stage ran every microbatch once; a schedule's first step adds a metadata-inference
            # forward (and loss call) before them, which the counts leave out.
            n = self.dims.microbatches
            load = empty_load(self.moe_rows, self.model_parts[0].config.num_experts, labels.device)
            for stage in self.model_parts:
                load += sum(stage.expert_loads[-n:])
        finally:
            for stage in self.model_parts:
                stage.expert_loads = None
        for hook in self.after_backward:
            hook()
        # Data ranks hold parts of each sum, only the last stage has the loss, tensor ranks hold copies.
        terms = self.loss_fn.take_terms(n).to(labels.device)
        values = torch.cat([local.float().reshape(1), terms])
        dist.all_reduce(values)
        dist.all_reduce(load)  # stages fill their own rows; data ranks add up
        loss, lm, mtp = (values / self.dims.tp).unbind()
        depths = self.loss_fn.mtp_depths
        ran_mtp = depths > 0 and labels.shape[1] > 1 + depths  # the model's condition for its MTP loss
        return StepResult(loss, lm, mtp if ran_mtp else None, load // self.dims.tp)

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

    def eval_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self._pipeline_eval is not None:
            with fsdp_view_warning_ignored():
                return self._pipeline_eval(input_ids)
        return next_token_logits(self.model_parts[0], input_ids)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=self.dp_group)
        return out

    def all_reduce_eval_sums(self, t: torch.Tensor) -> torch.Tensor:
        out = self.all_reduce_sum(t)
        if self.dims.pp > 1:  # only the last stage's ranks hold them: the others add zeros
            dist.all_reduce(out, group=self.mesh["pp"].get_group())
        return out

    def is_logging_rank(self) -> bool:
        return dist.get_rank() == 0
