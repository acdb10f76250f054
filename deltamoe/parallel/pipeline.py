"""Pipeline parallelism with torch.distributed.pipelining: which stages a rank holds, and the schedule.

Stages are `ModelStage`s over the AttnRes-aware split (`stage_split.py`). With virtual stages
(interleaved 1F1B) rank r holds stages r, r + pp, r + 2*pp, ... (the "loop" placement), so the
first and the last stage sit on ranks 0 and pp-1 as with plain 1F1B.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule

from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.stage_module import ModelStage


def stage_ids(pp_rank: int, dims: ParallelDims) -> list[int]:
    return [pp_rank + v * dims.pp for v in range(dims.stages_per_rank)]


def build_schedule(stages: list[ModelStage], ids: list[int], dims: ParallelDims, pp_mesh: DeviceMesh,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   device: torch.device) -> _PipelineSchedule:
    """The schedule over this rank's stages. Gradients are not scaled by the microbatch count: the loss is
    already normalised by the global token count (loss.py), so microbatch gradients must add up."""
    group = pp_mesh.get_group()
    pipeline_stages = [PipelineStage(stage, i, dims.num_stages, device, group=group) for stage, i in zip(stages, ids)]
    if dims.schedule == "1f1b":
        return Schedule1F1B(pipeline_stages[0], dims.microbatches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(pipeline_stages, dims.microbatches, loss_fn=loss_fn, scale_grads=False)
