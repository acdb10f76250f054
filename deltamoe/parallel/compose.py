"""`parallelize(model, dims, mesh)`: apply the parallelisms in torchtitan order and return the ParallelModel.

`dims` are resolved and checked (`ParallelDims.resolve`) before the process group exists; here they are
only applied.

Order: pipeline split -> tensor parallel -> expert parallel -> model converters (fp8 linears) ->
activation checkpointing -> activation offload -> FSDP2. Each step works on this rank's `ModelStage`s
only; the full model passed in can be dropped afterwards. On one process the converters,
checkpointing and offload apply to the whole model.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch import nn

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.api import LocalModel, ParallelModel
from deltamoe.parallel.checkpointing import apply_activation_checkpointing
from deltamoe.parallel.data_parallel import apply_fsdp
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.distributed_model import DistributedModel
from deltamoe.parallel.expert_load import moe_modules
from deltamoe.parallel.expert_overlap import OverlappedExpertDispatcher
from deltamoe.parallel.expert_parallel import ExpertParallelDispatcher, apply_expert_parallel
from deltamoe.parallel.loss import GlobalTokenLoss
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.parallel.offload import OffloadStats, apply_activation_offload
from deltamoe.parallel.pipeline import build_schedule, stage_ids
from deltamoe.parallel.stage_module import ModelStage
from deltamoe.parallel.stage_split import split_stages
from deltamoe.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: DeltaMoEForCausalLM, dims: ParallelDims, mesh: ParallelMesh | None,
                converters: Sequence[Callable[[nn.Module], None]] = ()) -> ParallelModel:
    """`converters` change modules in place (e.g. `train.fp8.Fp8Training`); they run on each stage
    once its layers are final and before checkpoint wrappers and FSDP2 see them."""
    config = model.config
    offload = OffloadStats() if dims.offload_targets else None
    if mesh is None:
        for convert in converters:
            convert(model)
        trunk = [str(i) for i in range(config.num_hidden_layers)]
        if dims.activation_checkpointing:
            apply_activation_checkpointing(model.model.layers, trunk)
        if offload is not None:
            apply_activation_offload(model.model.layers, trunk, dims.offload_targets, offload)
        local = LocalModel(model)
        local.offload_stats = offload
        return local

    ranges = split_stages(config, dims.num_stages)
    ids = stage_ids(mesh["pp"].get_local_rank(), dims)
    stages = [ModelStage(model, ranges[i], first=i == 0, last=i == dims.num_stages - 1) for i in ids]

    after_backward: list[Callable[[], None]] = []
    if dims.tp > 1:
        after_backward += [apply_tensor_parallel(stage, mesh["tp"]) for stage in stages]
    if dims.ep > 1:
        make_dispatcher = (functools.partial(OverlappedExpertDispatcher, chunks=dims.ep_chunks) if dims.ep_chunks > 1
                           else ExpertParallelDispatcher)
        for stage in stages:
            apply_expert_parallel(stage, mesh["ep"], make_dispatcher)
    for convert in converters:
        for stage in stages:
            convert(stage)
    if dims.activation_checkpointing:
        for stage in stages:
            apply_activation_checkpointing(stage.model.layers, stage.trunk_keys)
    if offload is not None:
        for stage in stages:
            apply_activation_offload(stage.model.layers, stage.trunk_keys, dims.offload_targets, offload)
    if dims.dp > 1:
        for stage in stages:
            apply_fsdp(stage, mesh, expert_parallel=dims.ep > 1, pipelined=dims.pp > 1)

    loss_fn = GlobalTokenLoss(config.mtp_depths, model.mtp_weight)
    schedule = None
    if dims.pp > 1:
        schedule = build_schedule(stages, ids, dims, mesh["pp"], loss_fn, torch.device(model.device))
    pm = DistributedModel(stages, mesh, dims, loss_fn, schedule, after_backward, len(moe_modules(model)))
    pm.offload_stats = offload
    return pm
