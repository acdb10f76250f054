import math

import pytest
import torch
from torch import nn

from deltamoe.train.config import OptimSection
from deltamoe.train.optim import LRSchedule, Optimizers, param_groups


def test_warmup_then_cosine_exact():
    s = LRSchedule(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert s(1) == pytest.approx(1e-4, abs=0) or s(1) == 1e-3 * 1 / 10
    assert s(5) == 1e-3 * 5 / 10
    assert s(10) == 1e-3
    assert s(60) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)), rel=1e-12)  # halfway
    assert s(60) == pytest.approx(5.5e-4, rel=1e-12)
    assert s(110) == pytest.approx(1e-4, rel=1e-12)
    assert s(500) == pytest.approx(1e-4, rel=1e-12)  # past the end it stays at the floor
    assert LRSchedule(2e-3, 0, 100, 0.0)(1) == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi / 100)), rel=1e-12)


def test_no_weight_decay_on_vectors():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    decay, no_decay = param_groups(m, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_set_lr_and_grad_mean():
    m = nn.Linear(2, 2)
    opt = Optimizers([m], OptimSection(lr=1.0, warmup_steps=4), total_steps=8)
    assert opt.set_lr(2) == 0.5 and all(g["lr"] == 0.5 for g in opt.optimizers[0].param_groups)
    m.weight.grad = torch.full((2, 2), 3.0)
    opt.scale_grads(1 / 3)
    assert torch.allclose(m.weight.grad, torch.ones(2, 2))
