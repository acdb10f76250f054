"""The trainer's sending end of a weight sync: the policy's tensors, by name, to an engine.

`push_in_process`: a colocated engine (same process) stages the tensors directly.
`send_over_group`: the engine has been told the specs (its `update_weights`, in a thread or behind
the server's /update_weights route); the trainer learns whether every engine accepted them, then
broadcasts the buckets. Both sides cut the same buckets from the same specs (`plan_buckets`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from deltamoe.errors import RequestError
from deltamoe.serve.engine.weight_transfer import TensorSpec, TransferGroup, bucket_sizes, pack, plan_buckets
from deltamoe.serve.engine.weight_update import UpdateStats, WeightUpdater


def policy_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a sync sends: every tensor of the state dict (router-bias buffers included). An
    FSDP2-sharded model's shards are gathered whole (`full_tensor`): a collective, so every data
    rank calls this, and every rank gets the full tensors."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for name, t in model.state_dict().items()}


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in tensors.items()]


def push_in_process(updater: WeightUpdater, tensors: dict[str, torch.Tensor]) -> UpdateStats:
    """`tensors` from `policy_tensors`."""
    updater.start_weight_update()
    updater.update_weights_from_tensors(tensors.items())
    return updater.finish_weight_update()


def send_over_group(group: TransferGroup, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> None:
    """Rank 0's half of `WeightUpdater.update_weights`: agree, then one broadcast per bucket."""
    went, same_plan = group.agree(True, bucket_sizes(specs_of(tensors), bucket_bytes))
    if not went:
        raise RequestError("an engine rejected the update's tensors (its answer names the tensor)", field="weights")
    if not same_plan:
        raise RequestError("the tensors take other bytes than the specs the engines were told (a dtype_names or "
                           "shapes entry differs from the tensor sent): nothing was sent", field="weights")
    values = list(tensors.values())
    for bucket in plan_buckets(specs_of(tensors), bucket_bytes):
        group.broadcast(pack([values[i].cpu() for i in bucket]), src=0)
