"""MoonViT-style vision tower + projector (K3 native vision, spec §2.2), stored under
`vision_tower.*` and `mm_projector.*`.

An image [3, H, W] (H, W multiples of patch_size * merge, from `deltamoe.vision.preprocess`)
is cut into patches of patch_size x patch_size -> linear patch embedding + a learned
pos_emb_height x pos_emb_width position table resized to the image's patch grid -> pre-norm
blocks with 2-D rotary attention -> final norm -> 2x2 spatial merge (the 4 neighbours
concatenated) -> projector MLP -> RMSNorm into the text width: one embedding per merged
patch, which replaces one image placeholder token of the prompt. Images only (a video's
temporal mean-pool is a later addition; for one frame it is the identity).

Several images run as one packed sequence: patch embedding, MLPs and projections are one
matmul over every patch, attention is block-diagonal (an image attends to itself only), so a
batch of images gives each image the numbers it gets alone.

2-D rotary (MoonViT's, as transformers' Kimi-K2.5 port computes it): the head is cut into
Dh/2 rotation pairs of adjacent dims; pair k turns by col * f_{k//2} when k is even and by
row * f_{k//2} when k is odd, with f_j = theta^(-4j / Dh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltamoe.config import ModelConfig, VisionConfig
from deltamoe.model.norm import RMSNorm

ROPE_THETA = 10000.0


def rope_2d_angles(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotation angle of each pair [N, head_dim/2]: (col, row) * f_j interleaved, f_j = theta^(-4j/Dh)."""
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32, device=rows.device) / head_dim)
    return torch.stack([cols.float()[:, None] * freqs, rows.float()[:, None] * freqs], dim=-1).flatten(1)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs of x [N, H, Dh] by angles [N, Dh/2] (computed in fp32)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


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

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, D]: the patches of len(lengths) images one after the other; each attends to its own."""
        n = x.shape[0]
        h, dh = self.v.num_attention_heads, self.v.head_dim
        q, k, val = self.wqkv(self.norm0(x)).reshape(n, 3, h, dh).unbind(1)
        q, k = apply_rope_2d(q, angles), apply_rope_2d(k, angles)
        # [1, H, n_i, Dh]: with a batch dim torch's CPU SDPA takes its flash kernel; 3-D inputs fall
        # back to the math path, which materialises every image's n_i x n_i scores (2.1x slower
        # at 448 px: bench/bench_vision.py).
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi)))[0].transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), val.split(lengths))]
        x = x + self.wo(torch.cat(out).reshape(n, h * dh))
        return x + self.mlp(self.norm1(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.v = v
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False)
        self.pos_emb = nn.Parameter(torch.zeros(v.pos_emb_height, v.pos_emb_width, v.hidden_size))

    def positions(self, gh: int, gw: int) -> torch.Tensor:
        """The learned table resized to a gh x gw grid, raster order [gh*gw, D] (as is when the sizes agree)."""
        table = self.pos_emb
        if (gh, gw) != tuple(table.shape[:2]):
            table = F.interpolate(table.permute(2, 0, 1)[None].float(), size=(gh, gw),
                                  mode=self.v.pos_emb_interpolation, align_corners=False)[0].permute(1, 2, 0)
        return table.reshape(gh * gw, -1)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """patches [N, 3*p*p] (`patchify` of each image, concatenated) -> [N, D]."""
        x = F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1))  # a stride-p conv, per patch
        pos = torch.cat([self.positions(gh, gw) for gh, gw in grids])
        return x + pos.to(x.dtype)


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[3, H, W] -> [gh*gw, 3*p*p] in raster order, each patch flattened as the conv weight is (c, y, x)."""
    c, hgt, wid = image.shape
    p = patch_size
    if hgt % p or wid % p:
        raise ValueError(f"image size {hgt}x{wid} is not a multiple of the patch size {p}")
    return image.reshape(c, hgt // p, p, wid // p, p).permute(1, 3, 0, 2, 4).reshape(-1, c * p * p)


class VisionEncoder(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.num_hidden_layers))
        self.final_layernorm = RMSNorm(v.hidden_size, 1e-6)


class VisionTower(nn.Module):
    """`vision_tower`: images -> per-image features after the 2x2 merge [(gh/2)*(gw/2), 4*D]."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v)
        self.encoder = VisionEncoder(v)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        p, (mh, mw) = self.v.patch_size, self.v.merge_kernel_size
        grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
        for gh, gw in grids:
            if gh % mh or gw % mw or not gh or not gw:
                raise ValueError(f"image grid {gh}x{gw} patches is empty or not divisible by the merge kernel {mh}x{mw}")
        lengths = [gh * gw for gh, gw in grids]
        x = self.patch_embed(torch.cat([patchify(img, p) for img in images]), grids)
        dev = x.device
        rows = torch.cat([torch.arange(gh, device=dev).repeat_interleave(gw) for gh, gw in grids])
        cols = torch.cat([torch.arange(gw, device=dev).repeat(gh) for gh, gw in grids])
        angles = rope_2d_angles(rows, cols, self.v.head_dim)
        for block in self.encoder.blocks:
            x = block(x, angles, lengths)
        x = self.encoder.final_layernorm(x)
        return [merge_patches(part, gh, gw, mh, mw) for part, (gh, gw) in zip(x.split(lengths), grids)]


def merge_patches(x: torch.Tensor, gh: int, gw: int, mh: int, mw: int) -> torch.Tensor:
    """[gh*gw, D] raster -> [(gh/mh)*(gw/mw), mh*mw*D]: each mh x mw neighbourhood, row by row, concatenated."""
    return x.reshape(gh // mh, mh, gw // mw, mw, -1).permute(0, 2, 1, 3, 4).reshape((gh // mh) * (gw // mw), -1)


class MultiModalProjector(nn.Module):
    """`mm_projector`: merged features [n, 4*D_vision] -> image-token embeddings [n, hidden_size]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        v = config.vision
        self.proj = nn.Sequential(nn.Linear(v.projector_in, v.projector_in, bias=False), nn.GELU(),
                                  nn.Linear(v.projector_in, config.hidden_size, bias=False))
        self.post_norm = RMSNorm(config.hidden_size, v.projector_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


def merge_image_embeddings(text_embeds: torch.Tensor, image_embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put image embeddings [n, D], in order, at the n True positions of mask [B, T] in text_embeds [B, T, D]."""
    count = int(mask.sum())
    if count != image_embeds.shape[0]:
        raise ValueError(f"{count} image placeholder tokens but {image_embeds.shape[0]} image embeddings")
    return text_embeds.masked_scatter(mask[..., None], image_embeds.to(text_embeds.dtype))
