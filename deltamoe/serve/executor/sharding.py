"""One serving replica's shard on this rank, from the training stack's parallel plans.

Which module is column- or row-parallel, how KDA heads and their per-head parameters split, how
experts split and travel: all of it is `parallel/tensor_parallel.py` and `parallel/expert_parallel.py`,
applied here in the same order as in training (TP, then EP). Serving adds two things:
- the vocabulary-parallel embedding and LM head (`apply_vocab_parallel`, also in parallel/);
- `use_local_shards`: the planned DTensor modules become plain local-shard modules with the
  collective their placement implies (DTensor dispatch costs more than a decode call's math);
- `ReplicatedTokensDispatcher` around the EP dispatcher: in serving every EP rank holds the same
  tokens (rank 0 sends one batch to all), so each rank dispatches only its share of them through
  the training all-to-all, and an all-gather brings every token's expert output back to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.expert_load import moe_modules
from deltamoe.parallel.expert_parallel import ExpertParallelDispatcher, ExpertShard, apply_expert_parallel
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.parallel.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel
from deltamoe.serve.executor.local_shards import use_local_shards


class ReplicatedTokensDispatcher:
    """EP dispatch when every EP rank holds all N tokens: rank r routes rows [r*c, (r+1)*c) (c = ceil(N/ep))
    through the all-to-all dispatcher, then all ranks gather the results: each token's expert work runs
    once in the group, and each token is combined in the same expert-sorted order as on one process."""

    def __init__(self, inner: ExpertParallelDispatcher):
        self.inner = inner
        self.group, self.size = inner.group, inner.size
        self.rank = dist.get_rank(inner.group)

    def __call__(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: ExpertShard) -> torch.Tensor:
        n = z.shape[0]
        per = -(-n // self.size)
        lo, hi = min(self.rank * per, n), min((self.rank + 1) * per, n)
        mine = self.inner(z[lo:hi], weights[lo:hi], indices[lo:hi], experts)  # fp32 [hi - lo, D']
        padded = mine.new_zeros(per, z.shape[1])
        padded[: hi - lo] = mine
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts)[:n]


def shard_for_serving(model: DeltaMoEForCausalLM, dims: ParallelDims, mesh: ParallelMesh) -> DeltaMoEForCausalLM:
    """Keep this rank's shard of `model` (every rank passes the same full model): TP heads, widths and
    vocabulary over mesh["tp"], routed experts over mesh["ep"]. In place; returns the model."""
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])  # its gradient sync is for training only
        apply_vocab_parallel(model, mesh["tp"])
        use_local_shards(model, mesh["tp"].get_group())
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
        for moe in moe_modules(model):
            moe.dispatcher = ReplicatedTokensDispatcher(moe.dispatcher)
    return model
