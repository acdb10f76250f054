"""Reads the loss parts of each forward and adds extra loss terms, through a forward hook.

`ParallelModel.forward_backward` returns one scalar; the hook on the whole model sees the
CausalLMOutput first, so it can log `lm_loss` / `mtp_loss` separately and add a term (the
sequence balance loss) to `loss` before backward. Pipeline stages are not whole models and
have no such output: there the probe stays silent and only the total loss is logged.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deltamoe.model.model import CausalLMOutput


class LossProbe:
    def __init__(self, parts: list[nn.Module], extra_terms: list[Callable[[], torch.Tensor | None]] = ()):
        self.extra_terms = list(extra_terms)
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.handles = [p.register_forward_hook(self._hook) for p in parts]

    def _hook(self, module: nn.Module, inputs: tuple, output: object) -> object:
        if not isinstance(output, CausalLMOutput) or output.loss is None or not module.training:
            return None
        for term in self.extra_terms:
            extra = term()
            if extra is not None:
                output.loss = output.loss + extra
                self._add("balance_loss", extra)
        self._add("lm_loss", output.lm_loss)
        self._add("mtp_loss", output.mtp_loss)
        return output

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
