"""AdamW (one per model part, torchtitan-style, so pipeline stages keep their own state) and
the learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`.

The schedule is a pure function of the optimizer step, so resuming restores it by restoring
the step; there is no scheduler object whose state could drift from the step counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from deltamoe.train.config import OptimSection


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        """LR for optimizer step `step` (1-based): lr*step/warmup, then cosine to lr*min_lr_ratio at total_steps."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / decay_steps, 1.0)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linears, embeddings, experts); never norms, vectors, biases or router biases."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Optimizers:
    """One AdamW per model part, stepped together with one LR."""

    def __init__(self, parts: list[nn.Module], cfg: OptimSection, total_steps: int):
        self.parts = parts
        self.schedule = LRSchedule(cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
        self.optimizers = [torch.optim.AdamW(param_groups(p, cfg.weight_decay), lr=cfg.lr,
                                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps) for p in parts]

    def set_lr(self, step: int) -> float:
        lr = self.schedule(step)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        return lr

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def scale_grads(self, factor: float) -> None:
        """Gradient accumulation: summed micro-step gradients -> their mean."""
        if factor == 1.0:
            return
        for part in self.parts:
            for p in part.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
