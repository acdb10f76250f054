"""Data parallelism with FSDP2: `fully_shard` per decoder layer, then the stage root.

Routed experts are already split over the EP ranks, which are part of DP; they are FSDP-sharded
over the remaining data ranks ("dp_rep") only, with their own fully_shard so the layer's group
leaves them out. Gradients are summed, not averaged (divide factor 1): the loss is already
normalised by the global token count, and an expert's gradient already holds every EP rank's tokens.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from torch.distributed.fsdp import FSDPModule, fully_shard

from deltamoe.model.ffn import MoE
from deltamoe.model.mtp import MTPLayer
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.parallel.stage_module import ModelStage


@contextlib.contextmanager
def fsdp_view_warning_ignored() -> Iterator[None]:
    """Silence one FSDP2 warning while the training step runs.

    A decoder layer returns the AttnRes bank, which holds the layer's own input; FSDP2 hands a module
    its inputs as views (its post-backward hook is an autograd function) and warns when a view comes
    back out, because an in-place op on it would skip that hook. Bank entries are only ever read (the
    AttnRes mix), never modified in place, and the gradients of every layout are tested against one
    process (tests/parallel), so this one warning is noise.
    """
    with warnings.catch_warnings():
        # FSDPCheckpointWrapper: the same layer under activation checkpointing (--ac).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDPDecoderLayer|FSDPCheckpointWrapper)\) "
                                                  r"returned a view tensor")
        yield


def apply_fsdp(stage: ModelStage, mesh: ParallelMesh, expert_parallel: bool, pipelined: bool) -> None:
    dp_mesh, expert_mesh = mesh.dp, mesh["dp_rep"]
    # Under a pipeline every microbatch would all-gather again; keep the layer unsharded for the step.
    reshard = not pipelined
    for layer in stage.model.layers.values():
        ignored = set()
        for moe in (m for m in layer.modules() if isinstance(m, MoE)):
            if not expert_parallel:
                continue
            if expert_mesh.size() > 1:
                fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard)
            else:  # one copy per EP rank: nothing left to shard or reduce
                ignored |= set(moe.experts.parameters())
        if isinstance(layer, MTPLayer):
            # `MTPLayer.logits` runs outside the layer's forward, so its norm and head are units of their own.
            fully_shard(layer.shared_head.norm, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(layer.shared_head.head, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
