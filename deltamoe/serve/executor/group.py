"""The ranks of one serving replica: how they start, meet, and hear from rank 0.

Two ways in, one group out:
- `spawn_group`: `deltamoe serve --tp N --ep M` on one machine. Rank 0 opens a TCPStore on a port
  the OS picks (port 0: two servers on one host never collide) and starts ranks 1.. as
  `python -m deltamoe.serve.executor.worker` subprocesses that join through that store.
- `join_torchrun`: the same command under torchrun (one or many nodes): the process group comes
  from torchrun's environment, and ranks > 0 run the worker loop instead of the server.

Control: rank 0 broadcasts each step's `StepMessage` (small host data) over a gloo group of its own
(`broadcast_object_list`), which waits without a deadline, since a server may idle for hours. The
tensors of a step travel over the default group (gloo on CPU, NCCL on GPU), whose collectives give
up after `WorkerConfig.timeout_s`. Only rank 0 is ever the source of a control message.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deltamoe.errors import CheckpointError, ConfigError, DeltaMoEError
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.mesh import ParallelMesh, build_mesh
from deltamoe.serve.engine.runner import ModelCall
from deltamoe.serve.executor.config import WorkerConfig
from deltamoe.serve.executor.image_rows import StepImages
from deltamoe.serve.executor.placeholders import Fill
from deltamoe.serve.executor.shard_load import load_shard

# The control group waits for rank 0's next step as long as the server idles.
_IDLE_WAIT = datetime.timedelta(days=365)


@dataclass
class StepMessage:
    """Rank 0 -> every rank, once per engine step."""

    state_ops: list[tuple[int | None, int]]  # state-slot writes to replay first (`HybridCache.apply_state_ops`)
    calls: list[ModelCall]
    report: bool = False  # after the calls, gather every rank's `RankStats` to rank 0
    reset_stats: bool = False  # before the calls, start the rank's `RankStats` afresh (`forget_stats`)
    # One-step-ahead steps (`overlap.py`): where the calls' placeholders come from, and how many sampled
    # ids rank 0 broadcasts right after this message (0: none, the calls' ids are whole).
    fills: list[Fill | None] | None = None
    earlier_rows: int = 0
    # A P/D role: handed-off caches rank 0 broadcasts right after this message, before any sampled ids
    # (`kv_transfer/worker_state.LoadedCache`); every rank scatters them into its cache.
    loaded: list | None = None
    # A P/D prefill role over --tp ranks: after the calls, every rank sends its heads of these state
    # slots to rank 0 (`worker_state.send_heads`), whose push reads them whole.
    gather_slots: list[int] | None = None
    # Image rows of the calls (`image_rows.py`): broadcast after the message (and any sampled ids).
    images: StepImages | None = None
    # A --tp replica's prompt logprobs: per call, the (row, lo, hi) hidden-state rows rank 0 projects
    # through the (vocabulary-parallel, so collective) LM head after the call (`call_projections`).
    projections: list[list[tuple[int, int, int]]] | None = None


@dataclass
class StopMessage:
    """Rank 0 -> every rank: leave the worker loop and exit."""


@dataclass
class RankStats:
    """What a rank reports when asked: its forward time (the model calls of its steps)."""

    rank: int
    steps: int = 0
    forward_seconds_total: float = 0.0
    last_step_seconds: float = 0.0


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its shard and cache: every rank builds the same replica."""

    source: str  # checkpoint folder or preset (presets: seeded random weights, the same on every rank)
    dtype: str
    device: str
    engine: dict  # EngineConfig fields
    workers: dict  # WorkerConfig fields
    threads: int | None = None  # torch threads per rank on a CPU (rank 0 splits its own among the ranks)

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(**self.workers)

    def device_for(self, local_rank: int) -> str:
        return f"cuda:{local_rank}" if self.device.startswith("cuda") else self.device


@dataclass
class RankGroup:
    """This process's place in the replica: the world, the mesh for sharding, the control group."""

    rank: int
    dims: ParallelDims
    mesh: ParallelMesh
    control: dist.ProcessGroup
    device: str  # this rank's device
    processes: list[subprocess.Popen] = field(default_factory=list)  # ranks 1.. when rank 0 spawned them

    @property
    def world_size(self) -> int:
        return self.dims.world_size()

    def broadcast(self, message: StepMessage | StopMessage) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> StepMessage | StopMessage:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def gather_stats(self, stats: RankStats) -> list[RankStats] | None:
        out: list[object] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(stats, out, dst=0, group=self.control)
        return out  # type: ignore[return-value]


def _backend(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def _finish_join(rank: int, dims: ParallelDims, device: str) -> RankGroup:
    control = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
    mesh = build_mesh(dims, "cuda" if device.startswith("cuda") else "cpu")
    return RankGroup(rank, dims, mesh, control, device)


def spawn_group(spec: WorkerSpec, dims: ParallelDims) -> RankGroup:
    """Rank 0 of a one-machine replica: start ranks 1.. as subprocesses and meet them."""
    timeout = datetime.timedelta(seconds=spec.worker_config().timeout_s)
    world = dims.world_size()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    processes = []
    try:
        for rank in range(1, world):
            args = {"spec": dataclasses.asdict(spec), "rank": rank, "world_size": world, "port": store.port}
            processes.append(subprocess.Popen([sys.executable, "-m", "deltamoe.serve.executor.worker",
                                               json.dumps(args)]))
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(0)
        dist.init_process_group(_backend(spec.device), store=dist.PrefixStore("deltamoe", store), rank=0,
                                world_size=world, timeout=timeout)
        group = _finish_join(0, dims, spec.device_for(0))
    except BaseException:
        for p in processes:
            p.kill()
            p.wait()
        raise
    group.processes = processes
    group._store = store  # type: ignore[attr-defined]  # the rendezvous lives as long as the group
    return group


def join_spawned(spec: WorkerSpec, dims: ParallelDims, rank: int, world: int, port: int) -> RankGroup:
    """A spawned rank > 0: join rank 0's store."""
    timeout = datetime.timedelta(seconds=spec.worker_config().timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(spec.device), store=dist.PrefixStore("deltamoe", store), rank=rank,
                            world_size=world, timeout=timeout)
    group = _finish_join(rank, dims, spec.device_for(rank))
    group._store = store  # type: ignore[attr-defined]
    return group


def join_torchrun(spec: WorkerSpec, dims: ParallelDims) -> RankGroup:
    """Any rank of a torchrun job whose world is this replica (MASTER_ADDR/PORT are torchrun's)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != dims.world_size():
        raise ValueError(f"torchrun started {world} processes but --tp {dims.tp} --ep {dims.ep} needs "
                         f"{dims.world_size()}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=spec.worker_config().timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(_backend(spec.device), timeout=timeout)
    return _finish_join(rank, dims, spec.device_for(local_rank))


def build_shard(spec: WorkerSpec, group: RankGroup) -> DeltaMoEForCausalLM | None:
    """This rank's shard, read from the checkpoint (or cut from a preset's seeded weights), once every
    rank has loaded its own. Each rank reads different files (its experts), so one rank alone may
    meet a bad one: the ranks exchange how loading went, and rank 0 raises the first rank's error as
    its own (CheckpointError naming the file), where it would otherwise see a dead worker at its first
    step. A rank > 0 gets None when any rank failed: it has nothing to serve and exits quietly."""
    model, error = None, None
    try:
        model = load_shard(spec.source, getattr(torch, spec.dtype), group.device, group.dims, group.mesh)
    except DeltaMoEError as e:
        error = (type(e).__name__, e.one_line())  # a DeltaMoEError subclass
    except Exception as e:  # a bug, not the user's input: its traceback is printed by the rank that met it
        traceback.print_exc()
        error = (type(e).__name__, f"{type(e).__name__}: {e}")
    outcomes: list[object] = [None] * group.world_size
    dist.all_gather_object(outcomes, error, group=group.control)
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return model
    if group.rank != 0:
        return None
    rank, (kind, message) = failed[0]
    where = "" if rank == 0 else f"worker rank {rank}: "
    error_type = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}.get(kind, RuntimeError)
    raise error_type(f"{where}{message}")
