"""Expert load as a value: the tokens each routed expert received in a training step.

Every MoE forward leaves its per-expert token counts in `MoE.last_expert_load`. The parallel layer
collects them right after the forward that produced them (no hooks) into one [MoE layers, experts]
int64 tensor whose rows are the model's MoE layers in layer order (trunk, then MTP), the same rows on
every rank whatever the layout, so stages and data ranks combine with one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.ffn import MoE


def moe_modules(module: nn.Module) -> list[MoE]:
    """The MoE blocks under `module`, in layer order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def empty_load(rows: int, experts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(rows, experts, dtype=torch.int64, device=device)


@torch.no_grad()
def take_expert_load(moes: dict[int, MoE], load: torch.Tensor) -> None:
    """Add each MoE's last forward into its row of `load` and consume it, so a block that did not run
    (MTP on rows too short for it) adds nothing the next time."""
    for row, moe in moes.items():
        if moe.last_expert_load is not None:
            load[row] += moe.last_expert_load.to(load.device)
            moe.last_expert_load = None
