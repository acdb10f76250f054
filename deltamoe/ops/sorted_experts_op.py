"""The expert-sorted forms as opaque ops that a compiled graph calls: `ops.moe.experts_forward`
(`deltamoe::sorted_experts`) and the int4 stack's expert-by-expert loop (`deltamoe::int4_sorted_experts`).

The sorted form slices rows per expert by counts read back to the host, which a graph cannot
hold; called as a plain function inside a compiled region it is a graph break, and the code dynamo
resumes after a break is guarded like any frame, without the region's key (`compiled_regions.py`),
so two models in one process could share it. As a custom op it is one call in the graph: its
output's shape and dtype follow from the inputs alone (fp32 [N, D], fp64 for fp64 inputs), which
is all the compiler needs (`register_fake`); the call itself runs the eager code.
"""

from __future__ import annotations

import torch

from deltamoe.ops import int4_experts, moe


@torch.library.custom_op("deltamoe::sorted_experts", mutates_args=())
def sorted_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, act: str, situ_beta: float,
                   situ_linear_beta: float) -> torch.Tensor:
    return moe.experts_forward(x, weights, indices, w1, w3, w2, act=act, situ_beta=situ_beta,
                               situ_linear_beta=situ_linear_beta)


@sorted_experts.register_fake
def _sorted_experts_fake(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, act: str, situ_beta: float,
                         situ_linear_beta: float) -> torch.Tensor:
    return x.new_empty((x.shape[0], w2.shape[1]), dtype=moe._combine_dtype(x))


@torch.library.custom_op("deltamoe::int4_sorted_experts", mutates_args=())
def int4_sorted_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w13: torch.Tensor,
                        sz13: torch.Tensor, w2: torch.Tensor, sz2: torch.Tensor, intermediate: int,
                        out_features: int, group_size: int, act: str, situ_beta: float,
                        situ_linear_beta: float) -> torch.Tensor:
    """`int4_experts.int4_experts_by_expert` on an int4 expert stack (`ExpertOperands`' four tensors)."""
    return int4_experts.int4_experts_by_expert(x, weights, indices, int4_experts.ExpertOperands(w13, sz13, w2, sz2),
                                               intermediate, out_features, group_size, act, situ_beta, situ_linear_beta)


@int4_sorted_experts.register_fake
def _int4_sorted_experts_fake(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w13: torch.Tensor,
                              sz13: torch.Tensor, w2: torch.Tensor, sz2: torch.Tensor, intermediate: int,
                              out_features: int, group_size: int, act: str, situ_beta: float,
                              situ_linear_beta: float) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.promote_types(x.dtype, torch.float32))
