"""Vision tower + projector against transformers' Kimi-K2.5 MoonViT (random weights), where the
architectures agree, and against the spec's formulas where K3 differs (RMSNorm, no biases, post-norm).

K2.5 has LayerNorms and biases where K3 has RMSNorms and none: the oracle runs with its biases zeroed
and its norms replaced by the same RMSNorms, so everything else (patch embedding, position-table
interpolation, 2-D rotary attention, MLP, 2x2 merge, projector MLP) is compared as transformers computes it.
"""

import pytest
import torch
from torch import nn

from deltamoe.config import VisionConfig
from deltamoe.model.norm import RMSNorm
from deltamoe.model.vision import MultiModalProjector, VisionTower, patchify
from deltamoe.config import load_preset

k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig  # noqa: E402

P, D, HEADS = 4, 16, 2


def _vision(mode: str) -> VisionConfig:
    return VisionConfig(patch_size=P, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, head_dim=D // HEADS,
                        intermediate_size=32, pos_emb_height=6, pos_emb_width=6, pos_emb_interpolation=mode)


def _oracle(mode: str) -> nn.Module:
    cfg = Kimi_K25VisionConfig(patch_size=P, pos_emb_height=6, pos_emb_width=6, num_attention_heads=HEADS,
                               num_hidden_layers=2, hidden_size=D, intermediate_size=32,
                               rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    model = k25.Kimi_K25VisionModel(cfg).eval()
    model.patch_embed.pos_emb.interpolation_mode = mode
    return model


def _half_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from transformers' rotate-half layout to adjacent rotation pairs (dim 2k <- k, 2k+1 <- k + Dh/2)."""
    dh = w.shape[0] // heads
    perm = torch.arange(dh).view(2, dh // 2).t().reshape(-1)
    return w.view(heads, dh, -1)[:, perm].reshape_as(w)


def _tie(ours: VisionTower, hf: nn.Module) -> None:
    """Random weights on our side; the oracle gets the same (biases zero, norms = our RMSNorms)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
        hf.patch_embed.proj.weight.copy_(ours.patch_embed.proj.weight)
        hf.patch_embed.pos_emb.position_embeddings.copy_(ours.patch_embed.pos_emb)
        for mine, theirs in zip(ours.encoder.blocks, hf.layers):
            q, k, v = mine.wqkv.weight.chunk(3)
            # ours are in pair layout; the oracle's q/k in half layout map onto them by the permutation
            theirs.attn.q_proj.weight.copy_(_pairs_to_half(q, HEADS))
            theirs.attn.k_proj.weight.copy_(_pairs_to_half(k, HEADS))
            theirs.attn.v_proj.weight.copy_(v)
            theirs.attn.proj.weight.copy_(mine.wo.weight)
            theirs.mlp.fc1.weight.copy_(mine.mlp.fc0.weight)
            theirs.mlp.fc2.weight.copy_(mine.mlp.fc1.weight)
            theirs.norm1, theirs.norm2 = mine.norm0, mine.norm1
        hf.final_layernorm = ours.encoder.final_layernorm
    assert torch.equal(_half_to_pairs(_pairs_to_half(q, HEADS), HEADS), q)


def _pairs_to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    dh = w.shape[0] // heads
    perm = torch.arange(dh).view(dh // 2, 2).t().reshape(-1)
    return w.view(heads, dh, -1)[:, perm].reshape_as(w)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_tower_matches_kimi_k25_moonvit(mode):
    ours, hf = VisionTower(_vision(mode)).eval(), _oracle(mode)
    _tie(ours, hf)
    gen = torch.Generator().manual_seed(1)
    # 6x4 patches (resized table), 8x8 (resized), 6x6 (the table as is)
    images = [torch.randn(3, 6 * P, 4 * P, generator=gen), torch.randn(3, 8 * P, 8 * P, generator=gen),
              torch.randn(3, 6 * P, 6 * P, generator=gen)]
    grid = torch.tensor([[1, 6, 4], [1, 8, 8], [1, 6, 6]])
    pixels = torch.cat([patchify(img, P) for img in images]).view(-1, 3, P, P)
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid).pooler_output.reshape(-1, 4 * D)
        got = torch.cat(ours(images))
    assert got.shape == (6 + 16 + 9, 4 * D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_images_equal_each_image_alone():
    tower = VisionTower(_vision("bilinear")).eval()
    _tie(tower, _oracle("bilinear"))
    gen = torch.Generator().manual_seed(2)
    images = [torch.randn(3, 4 * P, 10 * P, generator=gen), torch.randn(3, 2 * P, 2 * P, generator=gen)]
    with torch.no_grad():
        packed = tower(images)
        alone = [tower([img])[0] for img in images]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_projector_matches_kimi_k25_then_post_rmsnorm():
    from types import SimpleNamespace

    cfg = load_preset("tiny-vision").replace(vision=_vision("bilinear"))
    ours = MultiModalProjector(cfg).eval()
    hf_cfg = SimpleNamespace(vision_config=SimpleNamespace(hidden_size=D, merge_kernel_size=(2, 2)),
                             projection_hidden_size=D, projection_layer_norm_eps=1e-5,
                             text_config=SimpleNamespace(hidden_size=cfg.hidden_size))
    hf = k25.Kimi_K25MultimodalProjection(hf_cfg).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        hf.pre_norm = nn.Identity()  # K3's projector has no pre-norm
        hf.in_proj.weight.copy_(ours.proj[0].weight)
        hf.out_proj.weight.copy_(ours.proj[2].weight)
        hf.in_proj.bias.zero_()
        hf.out_proj.bias.zero_()
        x = torch.randn(5, 4, D)
        mlp = hf(x).reshape(5, -1)
        w, eps = ours.post_norm.weight, ours.post_norm.eps
        want = w * (mlp / torch.sqrt(mlp.pow(2).mean(-1, keepdim=True) + eps))  # spec: RMSNorm(eps 1e-5)
        torch.testing.assert_close(ours(x.reshape(5, -1)), want, rtol=1e-5, atol=1e-5)
