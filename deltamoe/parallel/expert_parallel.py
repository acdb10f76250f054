"""Expert parallelism: routed experts sharded along dim 0 over the EP group, tokens exchanged
with `all_to_all_single` (exact routing, no capacity, no dropped tokens).

Per MoE call on each EP rank: sort the (token, slot) pairs by expert, as `experts_forward`
does; the pairs for experts [r*E_l, (r+1)*E_l) go to rank r (one all-to-all for the latent
tokens, one for their local expert ids); each rank runs its local experts on what it received;
a second all-to-all brings the expert outputs back in the same order, where they are weighted
and summed in fp32 in the same expert-sorted order as the one-process combine.

Both token exchanges are an autograd Function, so the backward is the mirrored all-to-all and
expert weight gradients collect the contributions of every EP rank's tokens (they are summed,
never averaged with ranks that do not own the expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from deltamoe.model.ffn import MoE, RoutedExperts
from deltamoe.ops.moe import Linear, experts_forward


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; its backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    return AllToAll.apply(x, send, recv, group)


class ExpertShard(nn.Module):
    """This rank's slice of one layer's routed experts, in place of its RoutedExperts.

    The weights keep the names w1/w3/w2 (so checkpoints see `...experts.w1`) and are EP DTensors
    (Shard(0)) holding the full tensors' shapes; calling the experts as a module (rather than reading
    the weights from the dispatcher) is what lets FSDP2 unshard them over the remaining data ranks
    before use and reduce-scatter their gradients after.
    """

    def __init__(self, experts: RoutedExperts, ep_mesh: DeviceMesh):
        super().__init__()
        self.config = experts.config
        rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
        for name in ("w1", "w3", "w2"):
            # No communication: every rank starts from the same full weights and keeps its slice.
            local = getattr(experts, name).detach().chunk(size, dim=0)[rank].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                                          run_check=False)))
        self.linear: Linear | None = None  # the expert matmul; None: plain x @ w.T (fp8 training sets its own)

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """x [M, D'] routed here, local_ids [M]: unweighted expert outputs, fp32 [M, D']."""
        c = self.config
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        y = experts_forward(x, torch.ones(len(x), 1, dtype=torch.float32, device=x.device), local_ids[:, None],
                            w1, w3, w2, act=c.hidden_act, situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta,
                            linear=self.linear)
        if x.requires_grad and not y.requires_grad:
            # No pair landed here: keep the return trip (and zero expert gradients) in the graph, so this
            # rank joins the backward all-to-all and its expert shards get gradients like the other ranks'.
            y = y + (x.sum() + w1.sum() + w3.sum() + w2.sum()) * 0
        return y


@dataclass
class Route:
    """Where one batch's (token, slot) pairs go: expert-sorted, hence grouped by owner rank."""

    order: torch.Tensor  # [N*k] pair index in expert-sorted order
    token_of_slot: torch.Tensor  # [N*k] token of each sorted pair
    local_ids: torch.Tensor  # [N*k] expert id on its owner rank, sorted
    send: list[int]  # pairs sent to each rank
    recv: list[int]  # pairs received from each rank


class ExpertParallelDispatcher:
    """The MoE `dispatcher` for one EP group: (z [N, D'], weights [N, k], indices [N, k], experts) -> fp32 [N, D']."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.size = dist.get_world_size(group)
        self.experts_per_rank = num_experts // self.size

    def route(self, indices: torch.Tensor) -> Route:
        top_k = indices.shape[1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        owner = flat[order] // self.experts_per_rank
        send = torch.bincount(owner, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # how many pairs each rank sends us
        return Route(order, order // top_k, flat[order] - owner * self.experts_per_rank, send.tolist(), recv.tolist())

    @staticmethod
    def combine(y_sorted: torch.Tensor, weights: torch.Tensor, route: Route, num_tokens: int) -> torch.Tensor:
        # Unit weights in the expert compute: the routing weights are applied after the return trip,
        # in the sender's expert-sorted order, exactly as the one-process combine does.
        y_sorted = y_sorted * weights.reshape(-1)[route.order].to(y_sorted.dtype).unsqueeze(-1)
        return y_sorted.new_zeros(num_tokens, y_sorted.shape[1]).index_add(0, route.token_of_slot, y_sorted)

    def __call__(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: ExpertShard) -> torch.Tensor:
        r = self.route(indices)
        local_ids = all_to_all(r.local_ids, r.send, r.recv, self.group)
        received = all_to_all(z[r.token_of_slot], r.send, r.recv, self.group)
        y = self.run_local(experts, received, local_ids)
        return self.combine(all_to_all(y, r.recv, r.send, self.group), weights, r, indices.shape[0])

    @staticmethod
    def run_local(experts: nn.Module, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows routed here -> unweighted outputs, fp32 [M, D']."""
        return experts(x, local_ids)


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh,
                          make_dispatcher: Callable[[dist.ProcessGroup, int], ExpertParallelDispatcher]
                          = ExpertParallelDispatcher) -> None:
    """Replace every MoE's float routed experts by this rank's `ExpertShard` and install the all-to-all
    dispatcher `make_dispatcher(group, num_experts)` (the overlapped one: parallel/expert_overlap.py).
    MoEs whose experts are not `RoutedExperts` (a quantized checkpoint's packed experts, which serving
    shards itself: serve/executor/sharding.py) are left alone.

    The weights become DTensors (Shard(0)) so optimizers and torch.distributed.checkpoint see the full
    expert tensors; each rank keeps only its slice.
    """
    for moe in [m for m in module.modules() if isinstance(m, MoE) and isinstance(m.experts, RoutedExperts)]:
        moe.experts = ExpertShard(moe.experts, ep_mesh)
        moe.dispatcher = make_dispatcher(ep_mesh.get_group(), moe.config.num_experts)
