"""Images through DeltaMoEForCausalLM: placeholders replaced in order, decode after an image prefill
equals the full forward, and `vision_tower.*` / `mm_projector.*` round-trip through a checkpoint."""

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.errors import CheckpointError
from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model, load_model
from deltamoe.model.weights import save_checkpoint, state_dict_for_checkpoint

IMG = 264  # tiny-vision's <|image|>


@pytest.fixture(scope="module")
def model():
    return build_model(load_preset("tiny-vision"), seed=3).eval()


def _images():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 32, 48, generator=g), torch.randn(3, 16, 16, generator=g)]  # 2x3=6 and 1 tokens


def _prompt():
    return torch.tensor([[1, 2] + [IMG] * 6 + [3, 4, 5] + [IMG] + [6, 7, 8, 9]])


def test_images_replace_placeholders_in_order(model):
    ids, images = _prompt(), _images()
    with torch.no_grad():
        out = model(ids, images=images).logits
        e0, e1 = model.encode_images(images)
        h = model.model.embed_tokens(ids)
        h[0, 2:8], h[0, 11] = e0, e1[0]
        manual = model(ids, inputs_embeds=h).logits
        text_only = model(ids).logits
    torch.testing.assert_close(out, manual)
    assert (out[0, 2:] - text_only[0, 2:]).abs().max() > 1e-3  # the image changed what follows
    torch.testing.assert_close(out[0, :2], text_only[0, :2])  # and nothing before it


def test_wrong_placeholder_count_is_an_error(model):
    with pytest.raises(ValueError, match="7 image placeholder tokens but 6"):
        model(_prompt(), images=_images()[:1])


def test_decode_after_image_prefill_matches_full_forward(model):
    ids, images = _prompt(), _images()
    with torch.no_grad():
        full = model(ids, images=images).logits
        cache = ContiguousCache(model.config, batch_size=1, max_length=32)
        head = model(ids[:, :12], cache=cache, images=images).logits
        tail = [model(ids[:, t:t + 1], cache=cache).logits for t in range(12, ids.shape[1])]
    got = torch.cat([head, *tail], 1)
    assert ((got - full).norm() / full.norm()).item() <= 1e-5


def test_checkpoint_round_trip_keeps_vision(model, tmp_path):
    names = state_dict_for_checkpoint(model)
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names
    assert "vision_tower.patch_embed.pos_emb" in names and "mm_projector.proj.2.weight" in names
    assert "mm_projector.post_norm.weight" in names and "language_model.lm_head.weight" in names
    save_checkpoint(model, tmp_path)
    loaded = load_model(tmp_path)
    with torch.no_grad():
        a, b = model(_prompt(), images=_images()).logits, loaded(_prompt(), images=_images()).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a missing vision tensor is named
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["vision_tower.encoder.final_layernorm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="vision_tower.encoder.final_layernorm.weight"):
        load_model(tmp_path)


@torch.inference_mode()
def test_image_attention_takes_the_fused_kernel_and_keeps_images_apart(model):
    """Each image's attention is one SDPA call with a batch dim, which torch runs on its fused
    CPU kernel (3-D inputs took the math path that materialises every patches x patches score:
    the encoder at 0.38x transformers' at 448 px); two images packed give each what it gets alone."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(3)
    images = [torch.randn(3, 32, 48, generator=g), torch.randn(3, 16, 16, generator=g)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        packed = model.encode_images(images)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
    for img, got in zip(images, packed, strict=True):
        torch.testing.assert_close(got, model.encode_images([img])[0], rtol=1e-5, atol=1e-5)
