"""DeltaMoEForCausalLM: one forward for training, prefill and incremental decode.

Reads top to bottom like spec §3-§4: embed -> layers (AttnRes bank or plain residual) ->
output mix -> final norm -> LM head; optional MTP heads add a next-next-token loss.
Module names match the published checkpoints (`model.layers.N...`, `lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.model.decoder import DecoderLayer, Vector, res_query
from deltamoe.model.mtp import MTPLayer
from deltamoe.model.mtp_chain import mtp_states
from deltamoe.model.norm import RMSNorm
from deltamoe.model.vision import MultiModalProjector, VisionTower, merge_image_embeddings
from deltamoe.ops.norms import attn_res_mix

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # next-token CE (+ mtp_weight * MTP loss when MTP layers exist)
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None  # final pre-norm residual stream [B, T, D]


class DeltaMoEModel(nn.Module):
    """The trunk: `model.*` in the checkpoints."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # MTP layers follow the trunk layers in the checkpoints (index L + k).
        self.layers.extend(MTPLayer(config, config.num_hidden_layers + k) for k in range(config.num_nextn_predict_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = Vector(d, fill=1.0)
            self.output_attn_res_proj = Vector(1, d, fill=0.0)

    @property
    def trunk(self) -> list[DecoderLayer]:
        return list(self.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers[self.config.num_hidden_layers:])

    def forward(self, input_ids: torch.Tensor | None = None, cache: ModelCache | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the residual stream after the output AttnRes mix, before the final norm."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        bank: list[torch.Tensor] = []
        for layer in self.trunk:
            h, bank = layer(h, bank, cache)
        if self.config.attn_res_block_size is not None:
            h = attn_res_mix(h, bank, res_query(self.output_attn_res_norm, self.output_attn_res_proj),
                             self.config.rms_norm_eps)
        return h


class DeltaMoEForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DeltaMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp_weight = 0.3  # weight of the MTP loss in `loss` (DeepSeek-V3 uses 0.3 early in training)
        if config.vision is not None:  # native vision (K3): `vision_tower.*`, `mm_projector.*` in checkpoints
            self.vision_tower = VisionTower(config.vision)
            self.mm_projector = MultiModalProjector(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cache: ModelCache | None = None, inputs_embeds: torch.Tensor | None = None,
                logits_to_keep: int = 0, images: list[torch.Tensor] | None = None) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with input_ids (shifted inside, -100 ignored).

        images: preprocessed images [3, H, W] (`deltamoe.vision`), one per run of image placeholder
        tokens in input_ids, in row-major order; their embeddings replace the placeholders.

        logits_to_keep > 0 computes logits for the last that many positions only (decode and
        prefill want just the last one; the full-vocab projection of every prompt token is waste).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and logits_to_keep:
            raise ValueError("logits_to_keep must be 0 when labels are given (the loss needs every position)")
        if images is not None:
            if inputs_embeds is not None:
                raise ValueError("pass images or inputs_embeds, not both")
            encoded = self.encode_images(images)
            inputs_embeds = self.embed(input_ids, torch.cat(encoded) if encoded else
                                       self.lm_head.weight.new_zeros(0, self.config.hidden_size))
        h = self.model(input_ids, cache, inputs_embeds)
        logits = self.lm_head(self.model.norm(_last_positions(h, logits_to_keep, cache) if logits_to_keep else h))
        if cache is not None:
            cache.advance(input_ids.shape[1])
        out = CausalLMOutput(logits=logits, hidden_states=h)
        if labels is None:
            return out
        out.lm_loss = shifted_cross_entropy(logits, labels, shift=1)
        out.loss = out.lm_loss
        depths = self.config.mtp_depths
        if self.model.mtp_layers and input_ids.shape[1] > 1 + depths:
            # Depth k predicts token t+k+1 from the depth-(k-1) state at t and the embedding of token t+k.
            layers = self.model.mtp_layers
            states = mtp_states(layers, h, self.model.embed_tokens(input_ids), self.config.mtp_train_depth)
            losses = [shifted_cross_entropy(layers[min(k, len(layers) - 1)].logits(s), labels[:, k + 1:], shift=1)
                      for k, s in enumerate(states)]
            out.mtp_loss = torch.stack(losses).mean()
            out.loss = out.lm_loss + self.mtp_weight * out.mtp_loss
        return out

    def encode_images(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Preprocessed images [3, H, W] -> their image-token embeddings [n_i, hidden_size], one packed
        tower call for all of them."""
        if self.config.vision is None:
            raise ValueError("this model has no vision tower (config.vision is None)")
        if not images:
            return []
        features = self.vision_tower(images)
        return list(self.mm_projector(torch.cat(features)).split([f.shape[0] for f in features]))

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
              image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [B, T, D] with image_embeds [n, D] at the n positions of image_mask (default:
        the tokens equal to media_placeholder_token_id), in row-major order."""
        h = self.model.embed_tokens(input_ids)
        if image_embeds is None:
            return h
        if image_mask is None:
            if self.config.media_placeholder_token_id is None:
                raise ValueError("config.media_placeholder_token_id is None: no image placeholder token")
            image_mask = input_ids == self.config.media_placeholder_token_id
        return merge_image_embeddings(h, image_embeds, image_mask)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def _last_positions(h: torch.Tensor, keep: int, cache: ModelCache | None) -> torch.Tensor:
    """The last `keep` positions of each row: of its real tokens when the cache says rows are padded."""
    lengths = cache.new_lengths if cache is not None else None
    if lengths is None:
        return h[:, -keep:]
    cols = lengths[:, None] - keep + torch.arange(keep, device=h.device)  # [B, keep]
    return h.gather(1, cols[..., None].expand(-1, -1, h.shape[-1]))


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shift: int, reduction: str = "mean") -> torch.Tensor:
    """CE of logits[:, :-shift] against labels[:, shift:], ignoring IGNORE_INDEX ("mean" or "sum")."""
    pred = logits[:, :-shift].reshape(-1, logits.shape[-1]).float()
    target = labels[:, shift:].reshape(-1)
    return F.cross_entropy(pred, target, ignore_index=IGNORE_INDEX, reduction=reduction)
