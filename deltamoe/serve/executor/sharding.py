"""One serving replica's shard on this rank, from the training stack's parallel plans.

Which module is column- or row-parallel, how KDA heads and their per-head parameters split, how
experts split and travel: all of it is `parallel/tensor_parallel.py` and `parallel/expert_parallel.py`,
applied here in the same order as in training (TP, then EP). Serving adds:
- the vocabulary-parallel embedding and LM head (`apply_vocab_parallel`, also in parallel/);
- `use_local_shards`: the planned DTensor modules become plain local-shard modules with the
  collective their placement implies (DTensor dispatch costs more than a decode call's math);
- a quantized checkpoint: packed experts cut to the rank's share (`PackedExperts.local_share`),
  dispatched by the same all-to-all (`PackedExpertParallelDispatcher`), and int4 projections split
  by the same TP plan (`int4_shards.py`);
- `ReplicatedTokensDispatcher` around the EP dispatcher: in serving every EP rank holds the same
  tokens (rank 0 sends one batch to all), so each rank dispatches only its share of them through
  the training all-to-all, and an all-gather brings every token's expert output back to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.expert_load import moe_modules
from deltamoe.parallel.expert_parallel import ExpertParallelDispatcher, ExpertShard, apply_expert_parallel
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.parallel.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel
from deltamoe.serve.executor.int4_shards import shard_int4_projections
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


class PackedExpertParallelDispatcher(ExpertParallelDispatcher):
    """The training all-to-all dispatch for a quantized checkpoint's packed experts (`PackedExperts`
    holding this rank's share): the rows routed here run through the packed module with unit routing
    weights (the weights are applied after the return trip, as for float experts)."""

    @staticmethod
    def run_local(experts: PackedExperts, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(len(x), 1, dtype=torch.float32, device=x.device)
        return experts(x, ones, local_ids[:, None]).float()


def shard_for_serving(model: DeltaMoEForCausalLM, dims: ParallelDims, mesh: ParallelMesh) -> DeltaMoEForCausalLM:
    """Keep this rank's shard of `model` (every rank passes the same full model): TP heads, widths and
    vocabulary over mesh["tp"], routed experts over mesh["ep"]. In place; returns the model.

    A quantized checkpoint's skeleton (`quantize_modules` on the meta device) shards too, before
    loading: its packed routed experts (`PackedExperts`) are cut to this rank's share, and its int4
    projections (int4 / w4a8 checkpoints) split by the TP plan (`int4_shards.py`)."""
    if dims.tp > 1:
        # A quantized skeleton's int4 projections split by the same plan (the float ones below)
        shard_int4_projections(model, mesh["tp"].get_local_rank(), dims.tp, mesh["tp"].get_group())
        apply_tensor_parallel(model, mesh["tp"])  # its gradient sync is for training only
        apply_vocab_parallel(model, mesh["tp"])
        use_local_shards(model, mesh["tp"].get_group())
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"])  # float experts
        rank, group = mesh["ep"].get_local_rank(), mesh["ep"].get_group()
        for moe in moe_modules(model):
            if isinstance(moe.experts, PackedExperts):
                moe.experts = moe.experts.local_share(rank, dims.ep)
                moe.dispatcher = PackedExpertParallelDispatcher(group, moe.config.num_experts)
            moe.dispatcher = ReplicatedTokensDispatcher(moe.dispatcher)
    return model
