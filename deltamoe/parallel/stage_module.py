"""`ModelStage`: a contiguous slice of DeltaMoEForCausalLM that runs as one pipeline stage.

Parameter names stay those of the full model (`model.layers.12.self_attn...`, `lm_head.weight`),
so optimizers and torch.distributed.checkpoint see the published names on every stage. With one
stage (no pipeline) it is the whole model, so every layout runs the same forward.

The residual state crossing a stage boundary is (h, bank): h [B, T, D] and the AttnRes bank, a
list of [B, T, D] (one per finished block). It travels packed as one tensor [B, T, n+1, D] (bank
first, h last); n is fixed by where the stage starts. The bank's first entry is the embedding
output, which the MTP layers on the last stage read instead of the embedding table (the first
stage's); without AttnRes the embeddings travel in that slot only when there are MTP layers.

Expert load: while `expert_loads` is a list (the DistributedModel sets it for one step), each training
forward appends its MoE blocks' counts as a [MoE layers, experts] tensor (this stage's rows filled).
Counting here, once per stage forward, keeps activation-checkpoint recomputation (which reruns the
layers, not the stage) out of the counts, inside a pipeline schedule too; one entry per forward lets
the caller keep the microbatches' forwards and drop the schedule's metadata-inference forward.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.decoder import res_query
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.mtp_chain import mtp_states
from deltamoe.ops.norms import attn_res_mix
from deltamoe.parallel.expert_load import empty_load, moe_modules, take_expert_load


class ModelStage(nn.Module):
    def __init__(self, model: DeltaMoEForCausalLM, layers: range, first: bool, last: bool):
        super().__init__()
        config = model.config
        self.config, self.first, self.last = config, first, last
        self.use_attn_res = config.attn_res_block_size is not None
        self.mtp_count = config.num_nextn_predict_layers
        self.carry_embeds = self.mtp_count > 0 and not self.use_attn_res
        trunk = model.model
        self.model = nn.Module()  # same FQNs as DeltaMoEForCausalLM: model.*, lm_head
        if first:
            self.model.embed_tokens = trunk.embed_tokens
        self.trunk_keys = [str(i) for i in layers]
        self.mtp_keys = [str(config.num_hidden_layers + k) for k in range(self.mtp_count)] if last else []
        self.model.layers = nn.ModuleDict({key: trunk.layers[int(key)] for key in self.trunk_keys + self.mtp_keys})
        if last:
            self.model.norm = trunk.norm
            if self.use_attn_res:
                self.model.output_attn_res_norm = trunk.output_attn_res_norm
                self.model.output_attn_res_proj = trunk.output_attn_res_proj
            self.lm_head = model.lm_head
        rows = {id(m): row for row, m in enumerate(moe_modules(model))}
        self.moe_rows = len(rows)
        self.moe_layers = {rows[id(m)]: m for m in moe_modules(self.model.layers)}
        self.expert_loads: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids [B, T]; others: the packed state. Last stage: logits [B, T + sum_k (T - k), V]
        (next-token logits, then each MTP depth's), otherwise the packed state."""
        if self.first:
            h = self.model.embed_tokens(x)
            bank: list[torch.Tensor] = []
            embeds = h if self.carry_embeds else None
        else:
            h, bank, embeds = self._unpack(x)
        for key in self.trunk_keys:
            h, bank = self.model.layers[key](h, bank)
        if not self.last:
            out = torch.stack([*bank, *([embeds] if self.carry_embeds else []), h], dim=2)
        else:
            out = self._head(h, bank, embeds)
        if self.training and self.expert_loads is not None:
            load = empty_load(self.moe_rows, self.config.num_experts, out.device)
            take_expert_load(self.moe_layers, load)
            self.expert_loads.append(load)
        return out

    def _unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        parts = list(x.unbind(dim=2))
        h = parts.pop()
        embeds = parts.pop() if self.carry_embeds else None
        return h, parts, embeds

    def _head(self, h: torch.Tensor, bank: list[torch.Tensor], embeds: torch.Tensor | None) -> torch.Tensor:
        if self.use_attn_res:
            u = res_query(self.model.output_attn_res_norm, self.model.output_attn_res_proj)
            h = attn_res_mix(h, bank, u, self.config.rms_norm_eps)
            embeds = bank[0]  # layer 0 banks the raw embeddings
        logits = [self.lm_head(self.model.norm(h))]
        depths = self.config.mtp_depths
        if self.mtp_count and h.shape[1] > 1 + depths:  # the same condition as the model's MTP loss
            layers = [self.model.layers[key] for key in self.mtp_keys]
            # Depth k predicts token t+k+1 from the depth-(k-1) state at t and the embedding of token t+k.
            for k, state in enumerate(mtp_states(layers, h, embeds, self.config.mtp_train_depth)):
                logits.append(layers[min(k, len(layers) - 1)].logits(state))
        return torch.cat(logits, dim=1)
