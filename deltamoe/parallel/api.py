"""The contract between the trainer and the parallelism layer.

The trainer builds `ParallelDims`, calls `init_distributed` (torchrun environment) and
`parallelize`, then drives the returned `ParallelModel` once per step:
`forward_backward` -> `clip_grad_norm_` -> optimizer over `model_parts` -> zero grads.

Mesh layout (one DeviceMesh, torchtitan style): world = pp * dp * tp. Expert parallelism
does not add ranks: the EP group is carved out of the data-parallel ranks (ep divides dp),
so the mesh is ("pp", "dp_rep", "ep", "tp") with dp = dp_rep * ep. Each EP rank feeds its
own data slice and owns num_experts / ep experts; expert weights are FSDP-sharded over the
remaining dp_rep ranks, everything else over all dp ranks. Keeping EP inside DP (and out of
TP) means the tokens an EP group exchanges are distinct, not TP replicas of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.parallel.stage_split import split_stages

SCHEDULES = ("1f1b", "interleaved1f1b")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1  # data parallel (FSDP2); the EP group lives inside it
    tp: int = 1  # tensor parallel (attention heads, MLP widths)
    ep: int = 1  # expert parallel, carved out of dp: must divide dp
    pp: int = 1  # pipeline ranks
    schedule: str = "1f1b"  # "1f1b" | "interleaved1f1b"
    # Microbatches per step; the local batch must divide by it. With pp > 1 the pipeline schedule runs
    # them; otherwise they are gradient accumulation (FSDP reduces after the last one).
    microbatches: int = 1
    stages_per_rank: int = 1  # virtual pipeline stages per rank ("interleaved1f1b")
    activation_checkpointing: bool = False  # recompute each decoder layer in backward

    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def validate(self, config: ModelConfig, world_size: int | None = None) -> None:
        """Raise ConfigError naming the field; call before any process group exists."""
        for name in ("dp", "tp", "ep", "pp", "microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"expected a positive integer, got {value!r}", field=name)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"expected one of {SCHEDULES}, got {self.schedule!r}", field="schedule")
        if self.schedule == "1f1b" and self.stages_per_rank != 1:
            raise ConfigError(f"expected 1 for schedule '1f1b', got {self.stages_per_rank}", field="stages_per_rank",
                              hint="use schedule 'interleaved1f1b' for virtual stages")
        if world_size is not None and world_size != self.world_size():
            raise ConfigError(f"dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = {self.world_size()} ranks, "
                              f"but the world has {world_size}", field="world_size",
                              hint="ep does not add ranks: it is carved out of dp")
        self._validate_experts(config)
        self._validate_tensor_parallel(config)
        if self.pp > 1 and config.tie_word_embeddings:
            raise ConfigError("expected False with pp > 1: the embedding (first stage) and the LM head (last stage) "
                              "would be one tensor on two ranks", field="tie_word_embeddings")
        if self.pp > 1 or self.stages_per_rank > 1:
            split_stages(config, self.num_stages)  # raises when there are more stages than blocks
            if self.schedule == "interleaved1f1b" and self.microbatches % self.pp != 0:
                raise ConfigError(f"expected a multiple of pp ({self.pp}) for 'interleaved1f1b', "
                                  f"got {self.microbatches}", field="microbatches")

    def _validate_experts(self, config: ModelConfig) -> None:
        if self.ep == 1:
            return
        if config.num_experts == 0:
            raise ConfigError(f"expected 1 for a model without routed experts, got {self.ep}", field="ep")
        if config.num_experts % self.ep != 0:
            raise ConfigError(f"expected a divisor of num_experts ({config.num_experts}), got {self.ep}", field="ep")
        if self.dp % self.ep != 0:
            raise ConfigError(f"expected a divisor of dp ({self.dp}): the expert group is carved out of the "
                              f"data-parallel ranks, got {self.ep}", field="ep")

    def _validate_tensor_parallel(self, config: ModelConfig) -> None:
        if self.tp == 1:
            return
        widths: dict[str, int] = {}
        if "kda" in config.layer_types:
            widths["kda_num_heads"] = config.kda_num_heads
        if any(t in ("mla", "dsa") for t in config.layer_types) or config.num_nextn_predict_layers:
            widths["num_attention_heads"] = config.num_attention_heads
        if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            widths["intermediate_size"] = config.intermediate_size
        if config.num_experts > 0 and config.num_shared_experts > 0:
            widths["shared_expert_size"] = config.shared_expert_size
        for name, width in widths.items():
            if width % self.tp != 0:
                raise ConfigError(f"tp = {self.tp} must divide {name} ({width})", field="tp")


@runtime_checkable
class ParallelModel(Protocol):
    """What the trainer drives each step."""

    model_parts: list[nn.Module]  # this rank's modules: optimizer construction and torch.distributed.checkpoint
    dp_rank: int  # which slice of the global batch this rank feeds
    dp_size: int

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This DP rank's local batch [b, T] -> forward + backward; returns the detached loss of the global
        batch (the one-process value, same on every rank); gradients are left reduced across DP."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards and stages; return that norm."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a statistic (e.g. expert load) over the data ranks; identity on one process."""
        ...

    def is_logging_rank(self) -> bool:
        ...


class LocalModel:
    """The world-size-1 ParallelModel: the model as it is."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_parts = [model]
        self.dp_rank, self.dp_size = 0, 1

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(input_ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def is_logging_rank(self) -> bool:
        return True
