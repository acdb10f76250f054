"""Process group and DeviceMesh set-up from the torchrun environment.

One mesh ("pp", "dp_rep", "ep", "tp") with dp = dp_rep * ep flattened as "dp" (see dims.py for why
EP lives inside DP). Every parallelism takes its view of this one mesh, so FSDP2 can compose with
the TP and EP DTensors (they share the root mesh).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from deltamoe.parallel.dims import ParallelDims, launch_world_size

MESH_DIMS = ("pp", "dp_rep", "ep", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The world's DeviceMesh and its flattened data-parallel view (dp = dp_rep x ep). torch deprecates
    slicing a flattened dim back out of the root (`root["dp"]`) and asks callers to keep the mesh that
    `_flatten` returned, so the two travel together."""

    root: DeviceMesh
    dp: DeviceMesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """One named dim of the root: "pp", "dp_rep", "ep" or "tp"."""
        return self.root[name]

    def size(self) -> int:
        return self.root.size()


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(dims: ParallelDims, device: str | None = None) -> ParallelMesh:
    """The world's mesh; the process group must already exist."""
    device = device or device_type()
    root = init_device_mesh(device, (dims.pp, dims.data_size // dims.ep, dims.ep, dims.tp), mesh_dim_names=MESH_DIMS)
    # private but stable; torchtitan flattens its data dims the same way
    return ParallelMesh(root, root["dp_rep", "ep"]._flatten("dp"))


def init_distributed(dims: ParallelDims) -> ParallelMesh | None:
    """Join the torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and build the mesh; None when world == 1.

    `dims` come from `ParallelDims.resolve(config, world_size)`, which checks the layout against the
    world and the model before any process group exists.
    """
    world = launch_world_size()
    if world != dims.world_size():
        raise ValueError(f"dims are for {dims.world_size()} ranks but WORLD_SIZE is {world}: resolve them first")
    if world == 1:
        return None
    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return build_mesh(dims, device)
