"""One optimizer step, kept apart from the loop so other steps can replace it (RL updates) without
touching data, logging or checkpoints. (FP8 linears and activation offload change the modules
instead: train/fp8.py, parallel/offload.py.)

micro-batches -> forward_backward each (gradients add up; each returns its StepResult) -> mean
gradient -> clip by the global norm -> AdamW -> router-bias update from the step's expert load.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from deltamoe.parallel.api import ParallelModel, StepResult
from deltamoe.train.balance import SequenceBalanceLoss, balance_step
from deltamoe.train.config import TrainConfig
from deltamoe.train.data import Rows
from deltamoe.train.optim import Optimizers


@dataclass
class TrainStep:
    pm: ParallelModel
    optimizers: Optimizers
    seq_balance: SequenceBalanceLoss | None  # None when balance.alpha == 0
    cfg: TrainConfig
    device: torch.device

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.run.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __call__(self, step: int, micro_batches: list[Rows]) -> dict[str, float]:
        lr = self.optimizers.set_lr(step)
        results: list[StepResult] = []
        for rows in micro_batches:
            ids, labels = rows.input_ids.to(self.device), rows.labels.to(self.device)
            with self.autocast():
                results.append(self.pm.forward_backward(ids, labels))
        self.optimizers.scale_grads(1.0 / len(micro_batches))
        clip = self.cfg.optim.clip_grad if self.cfg.optim.clip_grad > 0 else math.inf
        grad_norm = self.pm.clip_grad_norm_(clip)
        self.optimizers.step()
        self.optimizers.zero_grad()
        record = {"loss": torch.stack([r.loss for r in results]).mean().item(), "lr": lr,
                  "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}
        record.update(self._loss_parts(results))
        loads = torch.stack([r.expert_load for r in results]).sum(0)
        record.update(balance_step(self.pm.moe_layers, loads, self.cfg.balance.gamma))
        return record

    def _loss_parts(self, results: list[StepResult]) -> dict[str, float]:
        """lm / mtp loss of the global batch (mean over micro-steps), and the balance loss averaged over
        the data ranks (each rank's hooks saw its own slice)."""
        parts = {"lm_loss": torch.stack([r.lm_loss for r in results]).double().mean().item()}
        if all(r.mtp_loss is not None for r in results):
            parts["mtp_loss"] = torch.stack([r.mtp_loss for r in results]).double().mean().item()
        if self.seq_balance is not None:
            balance = self.seq_balance.take()
            total = self.pm.all_reduce_sum(torch.tensor([balance or 0.0], dtype=torch.float64, device=self.device))
            parts["balance_loss"] = total.item() / self.pm.dp_size
        return parts
