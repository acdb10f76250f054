"""A real 4-rank gloo job under torch.profiler: 2 pipelines of 2 stages plus data parallelism.

Ranks 0->1 and 2->3 form pipelines (send/recv of activations and gradients); ranks {0, 2} and
{1, 3} all-reduce gradients. Rank 3 sleeps in each microbatch's compute: a slow host that the
others wait for. Usage: python gloo_job.py OUTDIR
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, schedule

MICROBATCHES, STEPS, SLOW_RANK, SLEEP_S = 2, 4, 3, 0.08  # sleep large against scheduling noise
# Stage 1 enters its all-reduce this much after stage 0 (see dp_stagger).
DP_STAGGER_S = 0.03


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_host(rank: int) -> None:
    """The slow rank's extra compute time, spent after its inputs arrived: gloo's sends block until
    the receiver posts its recv, and a rank held in a send is not modelled as waiting (see
    docs/traces.md), so sleeping before the recv would make its pipeline peer look late too."""
    if rank == SLOW_RANK:
        time.sleep(SLEEP_S)


def dp_stagger(stage: int) -> None:
    """Stage 1's wait before its data-parallel all-reduce. Without it ranks 2 and 3 release both
    pairs' all-reduces at about the same instant: all four ops overlap and may end within
    250 us, which a gloo trace (no group names) cannot tell from one all-reduce over the world
    (docs/traces.md). The stagger lets {0, 2} finish before rank 3 enters {1, 3}. Time spent before
    stage 1's next recv holds stage 0 in a send, which is not modelled as waiting, so it blames
    no rank."""
    if stage == 1:
        time.sleep(DP_STAGGER_S)


def _work(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp = dp_groups[rank % 2]
    stage, peer = rank % 2, rank ^ 1
    w = torch.randn(128, 128)
    x = torch.randn(128, 128)
    handler = lambda p: p.export_chrome_trace(f"{out}/worker{rank}.pt.trace.json")  # noqa: E731
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=STEPS - 1), on_trace_ready=handler) as prof:
        for _ in range(STEPS):
            grads = torch.zeros(128, 128)
            for _mb in range(MICROBATCHES):
                if stage == 0:
                    slow_host(rank)
                    act = x @ w
                    dist.send(act, dst=peer)
                    g = torch.empty(128, 128)
                    dist.recv(g, src=peer)
                    grads += g @ w
                else:
                    act = torch.empty(128, 128)
                    dist.recv(act, src=peer)
                    slow_host(rank)
                    y = act @ w
                    dist.send(y, dst=peer)
                    grads += y
            dp_stagger(stage)
            dist.all_reduce(grads, group=dp)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_work, args=(4, _free_port(), sys.argv[1]), nprocs=4)
