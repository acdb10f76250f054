"""One gloo job: every rank reads its shard straight from a checkpoint (`load_shard`) and compares it
with the whole model loaded then cut by the serving plans (`shard_for_serving(load_model(...))`).

Usage: python shard_load_job.py TP EP DTYPE CKPT RANK0_CKPT OUT.json
RANK0_CKPT is the folder rank 0 reads its shard from (CKPT with other ranks' expert files broken,
to show they are never opened); the other ranks read CKPT. Rank 0 writes, per rank: the tensors
that differ, the module types that differ, whether the LM head is the embedding, and the fraction
of the routed experts' and of all weights' elements the rank holds (and the experts' share of all).
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from deltamoe.hf_config import load_config  # noqa: E402
from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.parallel.mesh import build_mesh  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402
from deltamoe.serve.executor.shard_load import load_shard  # noqa: E402
from deltamoe.serve.executor.sharding import shard_for_serving  # noqa: E402


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def compare(tp: int, ep: int, dtype: torch.dtype, ckpt: str, mine: str) -> dict:
    dims = WorkerConfig(tp=tp, ep=ep).dims(load_config(ckpt))
    mesh = build_mesh(dims, "cpu")
    shard = load_shard(mine, dtype, "cpu", dims, mesh)
    whole = load_model(ckpt, dtype=dtype)
    tied = {"lm_head.weight"} if whole.config.tie_word_embeddings else set()  # the embedding, counted once
    total = sum(t.numel() for n, t in whole.state_dict().items() if n not in tied)
    experts = sum(t.numel() for n, t in whole.state_dict().items() if ".experts.w" in n)
    cut = shard_for_serving(whole, dims, mesh)
    a, b = shard.state_dict(keep_vars=True), cut.state_dict(keep_vars=True)
    differ = sorted(n for n in a.keys() | b.keys() if n not in a or n not in b
                    or _local(a[n]).dtype != _local(b[n]).dtype or not torch.equal(_local(a[n]), _local(b[n])))
    types = {n: type(m).__name__ for n, m in cut.named_modules()}
    type_differ = sorted(n for n, m in shard.named_modules() if types.get(n) != type(m).__name__)
    held = {n: _local(t).numel() for n, t in a.items() if n not in tied}
    return {"differ": differ, "type_differ": type_differ,
            "head_is_embedding": shard.lm_head.weight is shard.model.embed_tokens.weight,
            "expert_fraction": sum(v for n, v in held.items() if ".experts.w" in n) / experts,
            "weight_fraction": sum(held.values()) / total, "expert_share": experts / total}


def _worker(rank: int, world: int, port: int, args: list[str]) -> None:
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp, ep, dtype, ckpt, rank0_ckpt, out = args
    result = compare(int(tp), int(ep), getattr(torch, dtype), ckpt, rank0_ckpt if rank == 0 else ckpt)
    results: list[object] | None = [None] * world if rank == 0 else None
    dist.gather_object(result, results, dst=0)
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = sys.argv[1:]
    world = int(args[0]) * int(args[1])
    mp.spawn(_worker, args=(world, _free_port(), args), nprocs=world, join=True)
