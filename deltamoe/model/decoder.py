"""One decoder layer: attention (KDA | MLA | DSA) + FFN (dense | MoE), with Block AttnRes or plain residuals."""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.model.ffn import MoE, DenseMLP
from deltamoe.model.kda_layer import KimiDeltaAttention
from deltamoe.model.mla_layer import LatentAttention
from deltamoe.model.norm import RMSNorm
from deltamoe.ops.norms import attn_res_mix


class Vector(nn.Module):
    """A named parameter vector (`<name>.weight`), as the checkpoints store AttnRes norms and projections."""

    def __init__(self, *shape: int, fill: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


def res_query(norm: Vector, proj: Vector) -> torch.Tensor:
    """u = w_norm * w_proj, the AttnRes query of one mix point (spec §4.1)."""
    return norm.weight * proj.weight.reshape(-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, layer_type: str | None = None,
                 moe: bool | None = None, attn_res: bool | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = layer_type or config.layer_types[layer_idx]
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        if self.layer_type == "kda":
            self.self_attn = KimiDeltaAttention(config, layer_idx)
        else:
            self.self_attn = LatentAttention(config, layer_idx, use_dsa=self.layer_type == "dsa")
        self.is_moe = config.is_moe_layer(layer_idx) if moe is None else moe
        if self.is_moe:
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = DenseMLP(config, d, config.intermediate_size)
        use_res = config.attn_res_block_size is not None if attn_res is None else attn_res
        self.block_size = config.attn_res_block_size if use_res else None
        if self.block_size is not None:
            # Names as in the checkpoints: self_attention_res_{norm,proj}, mlp_res_{norm,proj}.
            # The norm and proj vectors of a mix point are only ever used as their product.
            self.self_attention_res_norm = Vector(d, fill=1.0)
            self.self_attention_res_proj = Vector(1, d, fill=0.0)
            self.mlp_res_norm = Vector(d, fill=1.0)
            self.mlp_res_proj = Vector(1, d, fill=0.0)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    def forward(self, h: torch.Tensor, bank: list[torch.Tensor], cache: ModelCache | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.block_size is None:  # plain pre-norm residual (Kimi Linear, MTP blocks)
            h = h + self.self_attn(self.input_layernorm(h), cache)
            return h + self.ffn(self.post_attention_layernorm(h)), bank
        eps = self.config.rms_norm_eps
        p = h
        x = attn_res_mix(p, bank, res_query(self.self_attention_res_norm, self.self_attention_res_proj), eps) if bank else p
        attn = self.self_attn(self.input_layernorm(x), cache)
        if self.layer_idx % self.block_size == 0:  # bank the raw layer input, restart the partial sum
            bank = [*bank, p]
            p = attn
        else:
            p = p + attn
        m = attn_res_mix(p, bank, res_query(self.mlp_res_norm, self.mlp_res_proj), eps)
        return p + self.ffn(self.post_attention_layernorm(m)), bank
