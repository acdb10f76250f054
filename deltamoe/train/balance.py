"""MoE load balance: aux-loss-free router-bias updates and an optional sequence-level balance loss.

DeepSeek-V3 balances experts mostly without a loss: after each optimizer step every layer's
selection bias moves by `gamma * sign(mean_load - load_e)`, so overloaded experts become less
likely to be picked. The load comes back from each `forward_backward` (StepResult.expert_load),
already summed over the data ranks and stages; the step sums its micro-steps, so every rank
applies the same update and the biases stay replicated. A small complementary sequence-wise
loss (alpha) can be added on top.
"""

from __future__ import annotations

import torch

from deltamoe.model.ffn import MoE


@torch.no_grad()
def update_router_biases(layers: dict[int, MoE], loads: torch.Tensor, gamma: float) -> None:
    """loads [rows, experts]: tokens per expert summed over the step; each layer (by its row) moves
    bias += gamma * sign(mean - load)."""
    loads = loads.float()
    for row, layer in layers.items():
        bias = layer.gate.e_score_correction_bias
        bias.add_(gamma * torch.sign(loads[row].mean() - loads[row]).to(bias.device))


def load_stats(loads: torch.Tensor) -> dict[str, float]:
    """max/mean expert load per layer: its mean over layers and its worst layer (1.0 is perfect balance)."""
    loads = loads.float()
    loads = loads[loads.sum(dim=1) > 0]  # layers that routed nothing (MTP in eval) say nothing
    if loads.numel() == 0:
        return {}
    ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)
    return {"expert_load_max_mean": ratio.mean().item(), "expert_load_max_mean_worst": ratio.max().item()}


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
        self.values: list[torch.Tensor] = []  # detached, read once per step (no host sync per layer)
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
        self.values.append(term.detach())
        return AttachAuxLoss.apply(output, term * self.grad_scale)

    def take(self) -> float | None:
        """Mean alpha-weighted term over the layer forwards since the last call."""
        if not self.values:
            return None
        out, self.values = torch.stack(self.values).double().mean().item(), []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def balance_step(layers: dict[int, MoE], loads: torch.Tensor, gamma: float) -> dict[str, float]:
    """After an optimizer step: the step's global loads [rows, experts] -> bias update -> stats for the
    metrics line. `layers` are this rank's MoE blocks by row (ParallelModel.moe_layers)."""
    if loads.numel() == 0:
        return {}
    if gamma > 0:
        update_router_biases(layers, loads, gamma)
    stats = load_stats(loads)
    if layers:  # a pipeline stage may hold no MoE block
        biases = torch.stack([m.gate.e_score_correction_bias.abs().mean() for m in layers.values()])
        stats["router_bias_abs_mean"] = biases.mean().item()
    return stats
