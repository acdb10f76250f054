"""Forward-only logits for evaluation: from the whole model, or through the pipeline stages.

A pipeline's training schedule (1F1B, interleaved) runs forward and backward together, so an
evaluation walks the stages itself: stage s runs on pipeline rank s % pp, takes the token ids
(stage 0) or the packed residual state its predecessor sends (`ModelStage`'s [B, T, n+1, D]),
and sends its output on; the last stage's output is the logits. The state's shape and dtype
travel first (the receiver cannot know the AttnRes bank's length at a stage boundary, nor what
autocast made of it). Every rank of a pipeline group walks the same loop, so the point-to-point
calls pair up in order; tensor- and expert-parallel peers run their stages' collectives as in
training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deltamoe.model.model import CausalLMOutput

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype index, number of dimensions, up to 6 sizes


def next_token_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] from the model, or from a whole-model ModelStage (whose output appends MTP logits)."""
    out = model(ids)
    return out.logits if isinstance(out, CausalLMOutput) else _stage_logits(out, ids.shape[1])


def _stage_logits(out: torch.Tensor, length: int) -> torch.Tensor:
    """The next-token logits [B, T, V] of a last stage's output (MTP depths' logits follow them),
    whole where tensor parallelism left them sharded."""
    logits = out[:, :length]
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


class PipelineEvalForward:
    """`stages`: this rank's `ModelStage`s, with their stage indices `stage_ids` (of `num_stages`)."""

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], num_stages: int, pp: int,
                 group: dist.ProcessGroup):
        self.mine = dict(zip(stage_ids, stages))
        self.num_stages, self.pp, self.group = num_stages, pp, group

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor | None:
        """[B, T, V] next-token logits on the rank holding the last stage; None on the others."""
        last = self.num_stages - 1
        x: torch.Tensor | None = None
        for s in range(self.num_stages):
            stage = self.mine.get(s)
            if stage is None:
                continue
            x = ids if s == 0 else self._receive((s - 1) % self.pp, ids.device)
            x = stage(x)
            if s < last:
                self._send(x, (s + 1) % self.pp)
        return _stage_logits(x, ids.shape[1]) if last in self.mine else None

    def _send(self, x: torch.Tensor, to: int) -> None:
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=x.device)
        header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
        header[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        dist.send(header, group=self.group, group_dst=to)
        dist.send(x.contiguous(), group=self.group, group_dst=to)

    def _receive(self, frm: int, device: torch.device) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, group=self.group, group_src=frm)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(x, group=self.group, group_src=frm)
        return x
