"""Multi-token prediction layer (spec §4.7, DeepSeek-V3 style), stored as `model.layers.{L+k}`.

h' = eh_proj([enorm(emb(x_{t+k})) ; hnorm(h_t)]) -> one decoder block (MLA, plain residual,
MoE) -> shared_head.norm -> shared_head.head. The embedding is the trunk's, passed in.
Used for the training loss now and as the draft model for speculative decoding later.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.model.decoder import DecoderLayer
from deltamoe.model.norm import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx, layer_type="mla", moe=config.num_experts > 0, attn_res=False)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,  # type: ignore[override]
                cache: ModelCache | None = None) -> torch.Tensor:
        """hidden [B, T, D] at positions t; next_embeds [B, T, D] = embeddings of tokens t+k."""
        h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        h, _ = super().forward(h, [], cache)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))
