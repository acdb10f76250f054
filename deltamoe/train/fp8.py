"""`--fp8 blockwise`: the model's linears and routed experts compute in blockwise FP8 (DeepSeek-V3
tiling, `ops.fp8_linear`), forward and backward; parameters, gradients and optimizer state stay fp32.

Converted: every bias-free `nn.Linear` of the decoder layers (attention projections, KDA gates, the
DSA indexer, dense and shared-expert MLPs, latent MoE projections, MTP's eh_proj) and the routed
experts. Kept in full precision, as DeepSeek-V3 keeps them: the embedding, the output heads
(`lm_head`, MTP's `shared_head.head`), the router, norms and the attention / KDA cores.

The conversion is a model converter `parallelize` runs on each stage after expert parallelism and
before activation checkpointing and FSDP2, so the swapped modules are the ones FSDP shards. Each
converted module records its operands' relative quantisation error into an `Fp8ErrorStats`;
`Fp8Training.take()` returns the step's means per module for metrics.jsonl, on the steps
`begin_step` records (`run.fp8_stats_every`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from deltamoe.model.ffn import MoE, RoutedExperts
from deltamoe.ops.fp8_linear import Fp8ErrorStats, fp8_linear
from deltamoe.ops.moe import experts_forward
from deltamoe.parallel.expert_parallel import ExpertShard

RECIPES = ("blockwise",)
_KEPT_HEADS = ("lm_head", "shared_head.head")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class Fp8Linear(nn.Linear):
    """An `nn.Linear` (no bias) whose product is `fp8_linear`; it holds the same weight Parameter as the
    module it replaces, so parameter names, initialisation and checkpoints are unchanged."""

    def __init__(self, linear: nn.Linear, stats: Fp8ErrorStats):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        self.stats = stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.stats)


class Fp8LocalExperts:
    """The MoE dispatcher for experts on this process, with fp8 expert matmuls."""

    def __init__(self, stats: Fp8ErrorStats):
        self.linear = functools.partial(fp8_linear, stats=stats)

    def __call__(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: RoutedExperts) -> torch.Tensor:
        c = experts.config
        return experts_forward(z, weights, indices, experts.w1, experts.w3, experts.w2, act=c.hidden_act,
                               situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta, linear=self.linear)


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class Fp8Training:
    """The converter (`__call__(module)`, as `parallelize` takes it) and the stats of what it converted."""

    def __init__(self, recipe: str = "blockwise", stats_every: int = 1):
        if recipe not in RECIPES:
            raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
        if stats_every < 1:
            raise ValueError(f"stats_every: expected >= 1, got {stats_every}")
        self.stats: dict[str, Fp8ErrorStats] = {}
        self.stats_every = stats_every
        self.recording = True

    def __call__(self, module: nn.Module) -> None:
        for name, child in list(module.named_modules()):
            if isinstance(child, MoE):
                stats = self.stats.setdefault(_clean_name(f"{name}.experts"), Fp8ErrorStats())
                if isinstance(child.experts, ExpertShard):
                    child.experts.linear = functools.partial(fp8_linear, stats=stats)
                else:
                    child.dispatcher = Fp8LocalExperts(stats)
        for name, child in list(module.named_modules()):
            if type(child) is nn.Linear and child.bias is None and not name.endswith(_KEPT_HEADS):
                parent_name, _, leaf = name.rpartition(".")
                stats = self.stats.setdefault(_clean_name(name), Fp8ErrorStats())
                setattr(module.get_submodule(parent_name), leaf, Fp8Linear(child, stats))

    def begin_step(self, step: int, last_step: int) -> None:
        """Record the error on step 1, every `stats_every`-th step and the last step only: measuring
        it costs about as much as quantising once more, and it changes slowly from step to step."""
        self.recording = step == 1 or step % self.stats_every == 0 or step == last_step
        for s in self.stats.values():
            s.enabled = self.recording
            if self.recording:
                s.take()  # drop what forwards outside a training step (evaluation) recorded since

    def take(self) -> dict[str, dict[str, float]]:
        """Mean relative quantisation error of x, W and dy per converted module since the last call."""
        return {name: errs for name, s in self.stats.items() if (errs := s.take())}
