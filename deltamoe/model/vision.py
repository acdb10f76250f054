"""MoonViT-style vision tower + projector (K3 native vision, spec §2.2), stored under
`vision_tower.*` and `mm_projector.*`.

Patches of 14x14 -> linear patch embedding + a learned 64x64 position table (bilinearly
resized to the image grid) -> pre-norm blocks with 2-D rotary attention -> final norm ->
2x2 spatial merge -> projector MLP -> RMSNorm into the text width. Images only (a video's
temporal mean-pool is a later addition). The public K3 modeling file is not released, so the
2-D rotary split (first half of each head rotates with the row, second half with the column)
is our documented choice; checkpoint tensor names and shapes are as published.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltamoe.config import ModelConfig, VisionConfig
from deltamoe.model.norm import RMSNorm


def _rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate x [N, H, Dh]: the first Dh/2 dims by row index, the rest by column index."""
    half = x.shape[-1] // 2
    out = []
    for part, pos in ((x[..., :half], rows), (x[..., half:], cols)):
        d = part.shape[-1]
        freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
        ang = pos.float()[:, None] * freqs[None, :]  # [N, d/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        a, b = part.float()[..., ::2], part.float()[..., 1::2]
        out.append(torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2))
    return torch.cat(out, dim=-1).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.fc1 = nn.Linear(v.intermediate_size, v.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.v = v
        inner = v.num_attention_heads * v.head_dim
        self.norm0 = RMSNorm(v.hidden_size, 1e-6)
        self.wqkv = nn.Linear(v.hidden_size, 3 * inner, bias=False)
        self.wo = nn.Linear(inner, v.hidden_size, bias=False)
        self.norm1 = RMSNorm(v.hidden_size, 1e-6)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h, dh = self.v.num_attention_heads, self.v.head_dim
        q, k, val = self.wqkv(self.norm0(x)).reshape(n, 3, h, dh).unbind(1)
        q, k = _rope_2d(q, rows, cols), _rope_2d(k, rows, cols)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), val.transpose(0, 1))
        x = x + self.wo(o.transpose(0, 1).reshape(n, h * dh))
        return x + self.mlp(self.norm1(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.v = v
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False)
        self.pos_emb = nn.Parameter(torch.zeros(v.pos_emb_height, v.pos_emb_width, v.hidden_size))

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """image [3, H, W] (H, W multiples of patch_size * merge) -> patches [gh*gw, D]."""
        x = self.proj(image[None])[0]  # [D, gh, gw]
        gh, gw = x.shape[-2:]
        pos = F.interpolate(self.pos_emb.permute(2, 0, 1)[None].float(), size=(gh, gw), mode="bilinear",
                            align_corners=False)[0].to(x.dtype)
        return (x + pos).flatten(1).t(), gh, gw


class VisionEncoder(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.num_hidden_layers))
        self.final_layernorm = RMSNorm(v.hidden_size, 1e-6)


class VisionTower(nn.Module):
    """`vision_tower` + `mm_projector`: an image to a sequence of text-width embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vision is None:
            raise ValueError("config.vision is None: this model has no vision tower")
        v = config.vision
        self.v = v
        self.vision_tower = nn.Module()
        self.vision_tower.patch_embed = PatchEmbed(v)
        self.vision_tower.encoder = VisionEncoder(v)
        self.mm_projector = nn.Module()
        self.mm_projector.proj = nn.Sequential(nn.Linear(v.projector_in, v.projector_in, bias=False), nn.GELU(),
                                               nn.Linear(v.projector_in, config.hidden_size, bias=False))
        self.mm_projector.post_norm = RMSNorm(config.hidden_size, v.projector_eps)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """image [3, H, W] -> [(gh/m) * (gw/m), hidden_size] image-token embeddings."""
        x, gh, gw = self.vision_tower.patch_embed(image)
        rows = torch.arange(gh, device=x.device).repeat_interleave(gw)
        cols = torch.arange(gw, device=x.device).repeat(gh)
        for block in self.vision_tower.encoder.blocks:
            x = block(x, rows, cols)
        x = self.vision_tower.encoder.final_layernorm(x)
        mh, mw = self.v.merge_kernel_size
        if gh % mh or gw % mw:
            raise ValueError(f"image grid {gh}x{gw} is not divisible by the merge kernel {mh}x{mw}")
        x = x.reshape(gh // mh, mh, gw // mw, mw, -1).permute(0, 2, 1, 3, 4).reshape((gh // mh) * (gw // mw), -1)
        return self.mm_projector.post_norm(self.mm_projector.proj(x))


def merge_image_embeddings(input_ids: torch.Tensor, text_embeds: torch.Tensor, image_embeds: torch.Tensor,
                           placeholder_id: int) -> torch.Tensor:
    """Put image embeddings, in order, at the placeholder tokens of a [B, T] batch."""
    mask = input_ids == placeholder_id
    if int(mask.sum()) != image_embeds.shape[0]:
        raise ValueError(f"{int(mask.sum())} image placeholder tokens but {image_embeds.shape[0]} image embeddings")
    out = text_embeds.clone()
    out[mask] = image_embeds.to(out.dtype)
    return out
