"""Whole-model parity: a random-weight transformers KimiLinearForCausalLM, saved with save_pretrained,
loaded by `load_model`, gives the same logits (fp32), full forward and step-by-step decode."""

import pytest
import torch

from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import load_model

transformers = pytest.importorskip("transformers")


def tiny_kimi_linear(q_lora_rank=32, layers=((1, 2, 3), (4,))):
    cfg = transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=sum(map(len, layers)), num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.7,
        first_k_dense_replace=1,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": list(layers[0]), "full_attn_layers": list(layers[1])},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module", params=["q_lora", "direct_q"])
def saved_pair(request, tmp_path_factory):
    torch.manual_seed(0)  # forget-gate A_log / dt_bias come from _init_weights
    cfg = tiny_kimi_linear(q_lora_rank=32 if request.param == "q_lora" else None,
                           layers=((1, 2, 3), (4,)) if request.param == "q_lora" else ((1, 3, 4), (2, 5)))
    ref = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero correction bias and norm weights so a wrong mapping shows
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for m in ref.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.05 * torch.randn_like(m.e_score_correction_bias))
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_model(path)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_full_forward_logits_match(saved_pair):
    ref, ours = saved_pair
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape == (2, 70, 256)
    assert rel_err(got, expected) <= 1e-4


def test_step_by_step_decode_matches(saved_pair):
    ref, ours = saved_pair
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).logits
        cache = ContiguousCache(ours.config, batch_size=2, max_length=24)
        got = torch.cat([ours(ids[:, t:t + 1], cache=cache).logits for t in range(24)], 1)
    assert rel_err(got, expected) <= 1e-4


def test_loss_matches(saved_pair):
    ref, ours = saved_pair
    ids = torch.randint(3, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert abs(ref(ids, labels=ids).loss.item() - ours(ids, labels=ids).loss.item()) <= 1e-4
