"""Expert parallelism with the all-to-all hidden behind expert compute: the batch's tokens go through
the EP exchange in `chunks` pieces with asynchronous collectives, so one chunk's dispatch or combine
is in flight while another chunk's experts run (the two-micro-batches-in-flight idea of Megatron's
combined 1F1B, inside one MoE call).

Order per MoE call: route every chunk (small synchronous count exchanges) -> issue every chunk's
dispatch -> for each chunk: its experts (waiting on its own dispatch only) -> issue its combine ->
weight and sum each chunk once its combine lands. The collectives are torch's functional ones
(`all_to_all_single_autograd`): each returns at once and waits where its result is first read, and
their backward is the mirrored exchange. A token's k pairs stay in its chunk and in expert-sorted
order, so the sums are those of the one-chunk dispatcher; only the expert matmuls see fewer rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from deltamoe.parallel.expert_parallel import ExpertParallelDispatcher, ExpertShard


class OverlappedExpertDispatcher(ExpertParallelDispatcher):
    def __init__(self, group: dist.ProcessGroup, num_experts: int, chunks: int):
        super().__init__(group, num_experts)
        self.chunks = chunks

    def __call__(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: ExpertShard) -> torch.Tensor:
        # Every rank runs the same number of chunks (some may be empty), so the collectives pair up.
        rows = torch.tensor_split(torch.arange(indices.shape[0], device=z.device), self.chunks)
        routes = [self.route(indices[r]) for r in rows]
        dispatched = [(all_to_all_single(route.local_ids, route.recv, route.send, self.group),
                       all_to_all_single_autograd(z[r][route.token_of_slot], route.recv, route.send, self.group))
                      for r, route in zip(rows, routes)]
        combines = [all_to_all_single_autograd(experts(x, ids), route.send, route.recv, self.group)
                    for (ids, x), route in zip(dispatched, routes)]
        return torch.cat([self.combine(y, weights[r], route, len(r)) for y, r, route in zip(combines, rows, routes)])
