"""One optimizer step, kept apart from the loop so other steps can replace it (FP8 linears,
activation offload, RL updates) without touching data, logging or checkpoints.

micro-batches -> forward_backward each (gradients add up) -> mean gradient -> clip by the
global norm -> AdamW -> router-bias update from the step's expert load.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from deltamoe.parallel.api import ParallelModel
from deltamoe.train.balance import ExpertLoadMeter, SequenceBalanceLoss, balance_step
from deltamoe.train.config import TrainConfig
from deltamoe.train.data import Rows
from deltamoe.train.loss_probe import LossProbe
from deltamoe.train.optim import Optimizers


@dataclass
class TrainStep:
    pm: ParallelModel
    optimizers: Optimizers
    meter: ExpertLoadMeter
    probe: LossProbe | None  # None where no rank sees a whole-model output (pipeline stages)
    seq_balance: SequenceBalanceLoss | None  # None when balance.alpha == 0
    cfg: TrainConfig
    device: torch.device

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.run.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __call__(self, step: int, micro_batches: list[Rows]) -> dict[str, float]:
        lr = self.optimizers.set_lr(step)
        losses = []
        for rows in micro_batches:
            ids, labels = rows.input_ids.to(self.device), rows.labels.to(self.device)
            if self.probe is not None:
                self.probe.labels = labels
            with self.autocast():
                losses.append(self.pm.forward_backward(ids, labels))
        self.optimizers.scale_grads(1.0 / len(micro_batches))
        clip = self.cfg.optim.clip_grad if self.cfg.optim.clip_grad > 0 else math.inf
        grad_norm = self.pm.clip_grad_norm_(clip)
        self.optimizers.step()
        self.optimizers.zero_grad()
        record = {"loss": torch.stack(losses).float().mean().item(), "lr": lr,
                  "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}
        record.update(self._loss_parts())
        record.update(balance_step(self.meter.layers, self.meter, self.cfg.balance.gamma, self.pm.all_reduce_sum))
        return record

    def _loss_parts(self) -> dict[str, float]:
        """lm / mtp / balance loss, averaged over the data ranks (each rank saw its own slice)."""
        parts = self.probe.take() if self.probe is not None else {}
        if self.seq_balance is not None:
            parts["balance_loss"] = self.seq_balance.take() or 0.0
        names = [n for n in ("lm_loss", "mtp_loss", "balance_loss") if n in parts]
        if not names:
            return {}
        values = self.pm.all_reduce_sum(torch.tensor([parts[n] for n in names], dtype=torch.float64,
                                                     device=self.device))
        return {n: v / self.pm.dp_size for n, v in zip(names, values.tolist())}
