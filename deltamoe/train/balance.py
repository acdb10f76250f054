"""MoE load balance: aux-loss-free router-bias updates and an optional sequence-level balance loss.

DeepSeek-V3 balances experts mostly without a loss: after each optimizer step every layer's
selection bias moves by `gamma * sign(mean_load - load_e)`, so overloaded experts become less
likely to be picked. The load is summed over the micro-steps of the step and over the data
ranks, so every rank applies the same update and the biases stay replicated. A small
complementary sequence-wise loss (alpha) can be added on top.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deltamoe.model.ffn import MoE


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_router_biases(layers: list[MoE], loads: torch.Tensor, gamma: float) -> None:
    """loads [layers, experts]: tokens per expert summed over the step; bias += gamma * sign(mean - load)."""
    for layer, load in zip(layers, loads.float()):
        bias = layer.gate.e_score_correction_bias
        bias.add_(gamma * torch.sign(load.mean() - load).to(bias.device))


def load_stats(loads: torch.Tensor) -> dict[str, float]:
    """max/mean expert load per layer: its mean over layers and its worst layer (1.0 is perfect balance)."""
    loads = loads.float()
    loads = loads[loads.sum(dim=1) > 0]  # layers that routed nothing (MTP in eval) say nothing
    if loads.numel() == 0:
        return {}
    ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)
    return {"expert_load_max_mean": ratio.mean().item(), "expert_load_max_mean_worst": ratio.max().item()}


class ExpertLoadMeter:
    """Sums `last_expert_load` of every MoE layer over the forwards of one optimizer step.

    A forward hook (not a read after the step) because gradient accumulation runs several
    forwards per step. Activation-checkpoint recomputation counts a forward twice; the bias
    update only uses the sign of (mean - load), which uniform scaling leaves unchanged.
    """

    def __init__(self, layers: list[MoE]):
        self.layers = layers
        self.index = {id(m): i for i, m in enumerate(layers)}
        # int64 on the experts' device: exact counts, no host sync per forward.
        self.loads: torch.Tensor | None = None
        self.handles = [m.register_forward_hook(self._hook) for m in layers]

    def _hook(self, module: MoE, inputs: tuple, output: torch.Tensor) -> None:
        if module.training and module.last_expert_load is not None:
            load = module.last_expert_load.detach()
            if self.loads is None:
                self.loads = torch.zeros(len(self.layers), load.numel(), dtype=torch.int64, device=load.device)
            self.loads[self.index[id(module)]] += load

    def take(self) -> torch.Tensor:
        """[layers, experts] loads summed since the last call (zeros if no forward ran), then reset."""
        if self.loads is None:
            experts = self.layers[0].config.num_experts if self.layers else 0
            return torch.zeros(len(self.layers), experts, dtype=torch.int64)
        out, self.loads = self.loads, None
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3 complementary sequence-wise loss for one layer, before the alpha weight.

    scores [B, T, E] (sigmoid affinities, with grad), indices [B, T, k] (selected experts).
    Per sequence: f_e = E/(k T) * #tokens choosing e; P_e = mean_t of s_e / sum_j s_j;
    loss = sum_e f_e P_e, averaged over sequences (1.0 when perfectly balanced).
    """
    b, t, e = scores.shape
    chosen = torch.zeros(b, t, e, device=scores.device).scatter_(2, indices, 1.0)
    f = chosen.sum(1) * e / (top_k * t)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `output` whose backward also sends gradient 1 into `aux` (Megatron's
    MoEAuxLossAutoScaler): the balance loss joins backward without touching the loss value,
    so it works whatever computes the loss (the model, or a pipeline schedule's loss_fn)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, device=grad.device, dtype=torch.float32)


class SequenceBalanceLoss:
    """alpha * `sequence_balance_loss` of every MoE forward, attached to the layer output (hooks).

    The router is re-run inside the hook on the layer input: the MoE module keeps no scores
    with gradient, and re-running a [tokens, experts] matmul is cheap next to the experts.
    `grad_scale` turns this rank's per-forward mean into its share of the global-batch mean
    (1 / (data ranks * microbatches) where gradients are summed over those).
    """

    def __init__(self, layers: list[MoE], alpha: float, grad_scale: float = 1.0):
        self.alpha, self.grad_scale = alpha, grad_scale
        self.values: list[float] = []
        self.handles = [m.register_forward_hook(self._hook) for m in layers]

    def _hook(self, module: MoE, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or not torch.is_grad_enabled():
            return None
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(flat.float() @ module.gate.weight.float().t())
        with torch.no_grad():
            _, indices = module.gate(flat)
        b, t = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, flat.shape[0])
        term = self.alpha * sequence_balance_loss(scores.view(b, t, -1), indices.view(b, t, -1),
                                                  module.config.num_experts_per_token)
        self.values.append(term.detach().item())
        return AttachAuxLoss.apply(output, term * self.grad_scale)

    def take(self) -> float | None:
        """Mean alpha-weighted term over the layer forwards since the last call."""
        if not self.values:
            return None
        out, self.values = sum(self.values) / len(self.values), []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def balance_step(layers: list[MoE], meter: ExpertLoadMeter, gamma: float,
                 all_reduce_sum: AllReduce) -> dict[str, float]:
    """After an optimizer step: global loads -> bias update -> stats for the metrics line."""
    if not layers:
        return {}
    loads = all_reduce_sum(meter.take())
    if gamma > 0:
        update_router_biases(layers, loads, gamma)
    stats = load_stats(loads)
    biases = torch.stack([m.gate.e_score_correction_bias.abs().mean() for m in layers])
    stats["router_bias_abs_mean"] = biases.mean().item()
    return stats

