"""Random initialisation for training from scratch (checkpoints overwrite all of it).

Kept apart from the module constructors so that building on the meta device costs nothing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deltamoe.model.ffn import RoutedExperts, Router
from deltamoe.model.kda_layer import KimiDeltaAttention
from deltamoe.model.norm import RMSNorm
from deltamoe.model.vision import PatchEmbed

# Output projections feed the residual stream; scaling them by 1/sqrt(2L) keeps its variance flat.
_RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "routed_expert_up_proj")


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02, seed: int | None = None) -> None:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0 if seed is None else seed)
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1)
    out_std = std / math.sqrt(2 * num_layers)

    def normal_(t: torch.Tensor, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * s)

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal_(module.weight, out_std if leaf in _RESIDUAL_OUTPUTS else std)
        elif isinstance(module, nn.Conv1d):
            bound = 1.0 / math.sqrt(module.kernel_size[0])
            module.weight.copy_(torch.rand(module.weight.shape, generator=gen) * 2 * bound - bound)
        elif isinstance(module, nn.Conv2d):  # the vision patch embedding
            normal_(module.weight, std)
        elif isinstance(module, PatchEmbed):
            normal_(module.pos_emb, std)
        elif isinstance(module, RMSNorm) and name.startswith(("vision_tower.", "mm_projector.")):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, RoutedExperts):
            normal_(module.w1, std)
            normal_(module.w3, std)
            normal_(module.w2, out_std)
        elif isinstance(module, Router):
            normal_(module.weight, std)
            module.e_score_correction_bias.zero_()
        if isinstance(module, KimiDeltaAttention):
            # Decay rates spread over heads (Mamba/GDN practice): A in [1, 16], dt in [1e-3, 1e-1].
            module.A_log.copy_(torch.log(torch.rand(module.A_log.shape, generator=gen) * 15 + 1))
            dt = torch.exp(torch.rand(module.dt_bias.shape, generator=gen) * (math.log(0.1) - math.log(1e-3))
                           + math.log(1e-3))
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            module.o_norm.weight.fill_(1.0)
    for name, p in model.named_parameters():
        # Norm vectors start at one; AttnRes projections at zero (uniform mixing at step 0).
        if name.endswith("norm.weight") and p.dim() == 1 and "indexer" not in name:
            p.fill_(1.0)
        elif name.endswith("_res_proj.weight"):
            p.zero_()
