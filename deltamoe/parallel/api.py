"""The contract between the trainer and the parallelism layer.

The trainer resolves `ParallelDims` (dims.py) against the model and the world, calls
`init_distributed` (torchrun environment) and `parallelize`, then drives the returned
`ParallelModel` once per step: `forward_backward` -> `clip_grad_norm_` -> optimizer over
`model_parts` -> zero grads. Everything a step measures comes back from `forward_backward` as a
`StepResult`, already combined over data ranks, pipeline stages and microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from deltamoe.model.ffn import MoE
from deltamoe.parallel.eval_forward import next_token_logits
from deltamoe.parallel.expert_load import empty_load, moe_modules, take_expert_load
from deltamoe.parallel.offload import OffloadStats


@dataclass
class StepResult:
    """One forward + backward over the global batch, the same values on every rank (all detached)."""

    loss: torch.Tensor  # fp32 scalar: next-token CE + mtp_weight * mtp_loss, the one-process value
    lm_loss: torch.Tensor  # fp32 scalar: next-token CE over the global batch's targets
    mtp_loss: torch.Tensor | None  # fp32 scalar: mean over MTP depths of their CE; None when no MTP ran
    # int64 [MoE layers, experts]: tokens each routed expert received, rows in the model's layer order
    # (see ParallelModel.moe_layers), summed over data ranks, stages and microbatches.
    expert_load: torch.Tensor


@runtime_checkable
class ParallelModel(Protocol):
    """What the trainer drives each step."""

    model_parts: list[nn.Module]  # this rank's modules: optimizer construction and torch.distributed.checkpoint
    moe_layers: dict[int, MoE]  # this rank's MoE blocks by their row in StepResult.expert_load
    dp_rank: int  # which slice of the global batch this rank feeds
    dp_size: int

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> StepResult:
        """This DP rank's local batch [b, T] -> forward + backward; returns the global batch's values
        (one-process values, same on every rank); gradients are left reduced across DP."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards and stages; return that norm."""
        ...

    def eval_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the caller sets eval mode): [b, T, V] next-token logits of this data rank's rows,
        on every rank that holds the model's output; None on pipeline ranks without the last stage."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a statistic over the data ranks; identity on one process."""
        ...

    def all_reduce_eval_sums(self, t: torch.Tensor) -> torch.Tensor:
        """`all_reduce_sum`, then over the pipeline stages (only the last stage's ranks get logits
        from `eval_logits`, the others hold zeros); identity on one process."""
        ...

    def is_logging_rank(self) -> bool:
        ...


class LocalModel:
    """The world-size-1 ParallelModel: the model as it is."""

    offload_stats: OffloadStats | None = None  # set by parallelize when activations are offloaded

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_parts = [model]
        self.moe_layers = dict(enumerate(moe_modules(model)))
        self.dp_rank, self.dp_size = 0, 1

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> StepResult:
        out = self.model(input_ids, labels=labels)
        load = empty_load(len(self.moe_layers), self.model.config.num_experts, labels.device)
        take_expert_load(self.moe_layers, load)
        out.loss.backward()
        mtp = out.mtp_loss.detach().float() if out.mtp_loss is not None else None
        return StepResult(out.loss.detach().float(), out.lm_loss.detach().float(), mtp, load)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def eval_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return next_token_logits(self.model, input_ids)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_eval_sums(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def is_logging_rank(self) -> bool:
        return True
