"""Start a tp * ep replica from a model source: the ranks meet, each builds its shard.

`start_replica` is what `LLMEngine.from_pretrained(..., workers=WorkerConfig(tp, ep))` calls on the
process that will serve. On a torchrun rank > 0 the same call runs the worker loop until rank 0
stops, then returns None: that process has nothing else to do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from deltamoe.hf_config import load_config
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.executor.config import WorkerConfig, launched_by_torchrun
from deltamoe.serve.executor.group import RankGroup, WorkerSpec, build_shard, join_torchrun, spawn_group
from deltamoe.serve.executor.worker import serve_steps


def start_replica(source: str | Path, engine: EngineConfig, workers: WorkerConfig, dtype: torch.dtype,
                  device: str) -> tuple[DeltaMoEForCausalLM, RankGroup] | None:
    """(rank 0's shard, the group), or None on a torchrun rank > 0 once rank 0 has stopped it."""
    dims = workers.dims(load_config(source))
    threads = None
    if device.startswith("cpu"):  # the ranks share this machine's cores (torchrun: one rank's share each)
        threads = max(1, torch.get_num_threads() // (1 if launched_by_torchrun() else workers.world_size))
        torch.set_num_threads(threads)
    spec = WorkerSpec(str(source), str(dtype).removeprefix("torch."), device, dataclasses.asdict(engine),
                      dataclasses.asdict(workers), threads)
    group = join_torchrun(spec, dims) if launched_by_torchrun() else spawn_group(spec, dims)
    if group.rank != 0:
        try:
            serve_steps(spec, group)
        finally:
            dist.destroy_process_group()
        return None
    try:
        return build_shard(spec, group), group
    except BaseException:  # the spawned ranks would wait for rank 0's shard collectives until the timeout
        for process in group.processes:
            process.kill()
            process.wait()
        dist.destroy_process_group()
        raise
