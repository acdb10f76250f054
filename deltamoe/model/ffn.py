"""Feed-forward blocks: the dense GLU MLP and the (latent) MoE with shared experts (spec §4.5, §4.6)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.norm import RMSNorm
from deltamoe.ops.activations import glu
from deltamoe.ops.moe import expert_load, experts_forward, experts_forward_static, route_tokens, static_expert_form
from deltamoe.ops.sorted_experts_op import sorted_experts


class DenseMLP(nn.Module):
    """`down(act(gate(x), up(x)))` with act = SiLU-GLU (Kimi Linear) or SiTU (K3)."""

    def __init__(self, config: ModelConfig, hidden: int, width: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), c.hidden_act, c.situ_beta, c.situ_linear_beta))


class Router(nn.Module):
    """Sigmoid router; `e_score_correction_bias` steers selection only (aux-loss-free balancing)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # A buffer, not a parameter: it is updated from expert load, never by gradients.
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = x.float() @ self.weight.float().t()
        return route_tokens(logits, self.e_score_correction_bias if c.moe_router_bias else None,
                            c.num_experts_per_token, renormalize=c.moe_renormalize,
                            scaling_factor=c.routed_scaling_factor, num_expert_group=c.num_expert_group,
                            topk_group=c.topk_group)


class RoutedExperts(nn.Module):
    """All routed experts of one layer as stacked tensors: w1 (gate), w3 (up) [E, I, D'], w2 (down) [E, D', I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        e, i, d = config.num_experts, config.moe_intermediate_size, config.expert_dim
        self.w1 = nn.Parameter(torch.empty(e, i, d))
        self.w3 = nn.Parameter(torch.empty(e, i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))


def local_experts(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: RoutedExperts) -> torch.Tensor:
    """All experts on this process: the default dispatcher."""
    c = experts.config
    return experts_forward(z, weights, indices, experts.w1, experts.w3, experts.w2, act=c.hidden_act,
                           situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta)


def local_experts_static(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                         experts: RoutedExperts) -> torch.Tensor:
    """`local_experts` with shapes that never depend on the routing: the dispatcher a compiled graph
    runs (serve's compiled decode installs it on its own view of the model). Where the all-experts
    form would cost more than it saves (`static_expert_form`: many rows over many experts), the
    graph calls the sorted form as one opaque op instead (`ops.sorted_experts_op`)."""
    c = experts.config
    num_experts, inter, dim = experts.w1.shape
    if static_expert_form(z.shape[0], indices.shape[1], num_experts, dim, inter) == "sorted":
        return sorted_experts(z, weights, indices, experts.w1, experts.w3, experts.w2, c.hidden_act,
                              float(c.situ_beta), float(c.situ_linear_beta))
    return experts_forward_static(z, weights, indices, experts.w1, experts.w3, experts.w2, act=c.hidden_act,
                                  situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta)


class MoE(nn.Module):
    """Router -> (latent down) -> top-k experts -> (norm, latent up) + shared experts on the full-width input."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.gate = Router(config)
        self.experts = RoutedExperts(config)
        if config.latent_moe_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, config.latent_moe_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(config.latent_moe_size, d, bias=False)
            if config.latent_moe_norm:
                self.routed_expert_norm = RMSNorm(config.latent_moe_size, config.rms_norm_eps)
        if config.num_shared_experts > 0:
            self.shared_experts = DenseMLP(config, d, config.shared_expert_size)
        self.last_expert_load: torch.Tensor | None = None  # tokens per expert in the last forward
        # Expert parallelism swaps this for an all-to-all dispatch/combine with the same signature:
        # (z [N, D'], weights [N, k], indices [N, k], experts) -> fp32 [N, D'].
        self.dispatcher: Callable[..., torch.Tensor] = local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        with torch.no_grad():
            self.last_expert_load = expert_load(indices, c.num_experts)
        z = self.routed_expert_down_proj(flat) if c.latent_moe_size is not None else flat
        routed = self.dispatcher(z, weights, indices, self.experts).to(x.dtype)
        if c.latent_moe_size is not None:
            if c.latent_moe_norm:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if c.num_shared_experts > 0:
            routed = routed + self.shared_experts(flat)
        return routed.reshape(shape)
