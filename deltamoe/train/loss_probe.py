"""Reads the next-token and MTP parts of each training forward, through a forward hook.

`ParallelModel.forward_backward` returns one scalar. The hook sees the model's output first:
a CausalLMOutput (one process) carries `lm_loss` / `mtp_loss`; a whole-model ModelStage
(data/tensor/expert parallel without a pipeline) returns logits laid out as
[next-token | MTP depth 1 | ...] along the sequence, scored here against the labels the step
set. Pipeline stages hold no whole output: the probe is not installed there.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.model import CausalLMOutput, shifted_cross_entropy


class LossProbe:
    def __init__(self, parts: list[nn.Module]):
        self.labels: torch.Tensor | None = None  # the labels of the forward about to run (stage outputs)
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.handles = [p.register_forward_hook(self._hook) for p in parts]

    def _hook(self, module: nn.Module, inputs: tuple, output: object) -> None:
        if not module.training:
            return
        if isinstance(output, CausalLMOutput):
            self._add("lm_loss", output.lm_loss)
            self._add("mtp_loss", output.mtp_loss)
        elif isinstance(output, torch.Tensor) and self.labels is not None and inputs[0].shape == self.labels.shape:
            self._stage_parts(output.detach(), self.labels, getattr(module, "mtp_count", 0))

    @torch.no_grad()
    def _stage_parts(self, logits: torch.Tensor, labels: torch.Tensor, depths: int) -> None:
        t = labels.shape[1]
        depths = depths if logits.shape[1] > t else 0
        parts = logits.split([t - k for k in range(1 + depths)], dim=1)
        self._add("lm_loss", shifted_cross_entropy(parts[0], labels, shift=1))
        if depths:
            mtp = [shifted_cross_entropy(parts[k], labels[:, k:], shift=1) for k in range(1, 1 + depths)]
            self._add("mtp_loss", torch.stack(mtp).mean())

    def _add(self, name: str, value: torch.Tensor | None) -> None:
        if value is not None:
            self.sums[name] = self.sums.get(name, 0.0) + value.detach().float().item()
            self.counts[name] = self.counts.get(name, 0) + 1

    def take(self) -> dict[str, float]:
        """Mean of each part over the forwards since the last call (this rank's micro-batches)."""
        out = {k: self.sums[k] / self.counts[k] for k in self.sums}
        self.sums, self.counts = {}, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
