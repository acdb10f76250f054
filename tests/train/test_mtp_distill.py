"""MTP self-distillation: targets are the trunk's greedy tokens, only the MTP layer moves, and its
chained loss falls."""

from __future__ import annotations

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.model.model import IGNORE_INDEX
from deltamoe.train.mtp_distill import depth_loss, distill_mtp, lr_at, trunk_targets


def small_model():
    config = load_preset("tiny").replace(hidden_size=32, num_hidden_layers=2, layer_types=("kda", "mla"),
                                         kda_num_heads=2, kda_head_dim=8, num_attention_heads=2, q_lora_rank=16,
                                         kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                         intermediate_size=48, num_experts=4, num_experts_per_token=2,
                                         moe_intermediate_size=16, latent_moe_size=16, attn_res_block_size=None)
    return build_model(config, seed=1).eval()


def test_targets_are_the_trunk_argmax_and_skip_padding():
    model = small_model()
    pad = model.config.pad_token_id
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    ids[1, 7:] = pad
    _, labels = trunk_targets(model, ids, pad)
    with torch.no_grad():
        greedy = model(ids).logits.argmax(-1)
    assert (labels[:, 0] == IGNORE_INDEX).all() and (labels[1, 7:] == IGNORE_INDEX).all()
    assert torch.equal(labels[0, 1:], greedy[0, :-1]) and torch.equal(labels[1, 1:7], greedy[1, :6])


def test_only_the_mtp_layer_learns_and_its_loss_falls():
    model = small_model()
    trunk_before = {n: p.clone() for n, p in model.named_parameters() if ".layers.2." not in f".{n}"}
    mtp_before = [p.clone() for p in model.model.mtp_layers[0].parameters()]
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = distill_mtp(model, [ids] * 30, depth=2, lr=3e-3)
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]
    for n, p in model.named_parameters():
        if n in trunk_before:
            assert torch.equal(p, trunk_before[n]), n
    assert any(not torch.equal(p, q) for p, q in zip(model.model.mtp_layers[0].parameters(), mtp_before))
    assert all(p.grad is None for p in model.parameters())


def test_learning_rate_warms_up_then_follows_a_cosine_to_its_floor():
    assert [lr_at(s, 1.0, 4, None) for s in (1, 2, 4, 50)] == [0.25, 0.5, 1.0, 1.0]
    assert lr_at(4, 1.0, 4, 104) == 1.0 and lr_at(104, 1.0, 4, 104) == pytest.approx(0.1)
    assert lr_at(54, 1.0, 4, 104) == pytest.approx(0.55)  # halfway: the mean of 1 and the floor
    assert lr_at(3, 2.0, 0, 3, min_ratio=0.5) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_soft_loss_on_a_one_hot_teacher_is_the_greedy_loss_at_the_same_positions(k):
    """The teacher's position j predicts token j+1 (label j+1): a one-hot teacher built from the
    labels gives exactly the greedy cross-entropy, so the two targets are aligned at every depth."""
    g = torch.Generator().manual_seed(k)
    t, v = 12, 7
    labels = torch.randint(0, v, (3, t), generator=g)
    labels[:, 0] = IGNORE_INDEX
    labels[1, 5:] = IGNORE_INDEX  # padding
    labels[2, :4] = IGNORE_INDEX  # a prompt: not scored
    teacher = torch.zeros(3, t, v)
    teacher[:, :-1] = torch.nn.functional.one_hot(labels[:, 1:].clamp(min=0), v).float()
    logits = torch.randn(3, t - k - 1, v, generator=g)
    assert depth_loss(logits, labels, k, teacher).item() == pytest.approx(depth_loss(logits, labels, k).item(), rel=1e-5)
    # and a soft teacher is a real target: the loss is the cross-entropy against it, higher than its entropy
    soft = torch.softmax(torch.randn(3, t, v, generator=g), dim=-1)
    keep = labels[:, k + 2:] != IGNORE_INDEX
    expected = -(soft[:, k + 1:-1][keep] * torch.log_softmax(logits[:, :-1][keep], -1)).sum(-1).mean()
    assert depth_loss(logits, labels, k, soft).item() == pytest.approx(expected.item(), rel=1e-5)


def test_soft_distillation_moves_only_the_mtp_layer_towards_the_trunk():
    model = small_model()
    with torch.no_grad():  # a random trunk's next-token distribution is near uniform: the loss's floor,
        model.lm_head.weight.mul_(30)  # its entropy, would leave nothing to learn; a peaked one does
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    trunk_before = {n: p.clone() for n, p in model.named_parameters() if ".layers.2." not in f".{n}"}
    losses = distill_mtp(model, [ids] * 30, depth=2, lr=3e-3, soft=True)
    assert losses[-1] < 0.8 * losses[0]
    for n, p in model.named_parameters():
        if n in trunk_before:
            assert torch.equal(p, trunk_before[n]), n
