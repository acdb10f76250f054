"""Process group and DeviceMesh set-up from the torchrun environment.

One mesh ("pp", "dp_rep", "ep", "tp") with dp = dp_rep * ep flattened as "dp" (see api.py for why
EP lives inside DP). Every parallelism takes its view of this one mesh, so FSDP2 can compose with
the TP and EP DTensors (they share the root mesh).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from deltamoe.errors import ConfigError
from deltamoe.parallel.api import ParallelDims

MESH_DIMS = ("pp", "dp_rep", "ep", "tp")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(dims: ParallelDims, device: str | None = None) -> DeviceMesh:
    """The world's DeviceMesh; the process group must already exist."""
    device = device or device_type()
    mesh = init_device_mesh(device, (dims.pp, dims.dp // dims.ep, dims.ep, dims.tp), mesh_dim_names=MESH_DIMS)
    # private but stable; torchtitan flattens its data dims the same way
    _DATA_MESHES[mesh] = mesh["dp_rep", "ep"]._flatten("dp")
    return mesh


# The flattened "dp" mesh of each root mesh. torch deprecates slicing a flattened dim back out of
# the root (`mesh["dp"]`) and asks callers to keep the mesh `_flatten` returned.
_DATA_MESHES: dict[DeviceMesh, DeviceMesh] = {}


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel mesh (dp = dp_rep x ep) of a mesh made by `build_mesh`."""
    return _DATA_MESHES[mesh]


def init_distributed(dims: ParallelDims, config=None) -> DeviceMesh | None:
    """Join the torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and build the mesh; None when world == 1.

    The dims are validated against the world size first, so a wrong layout fails with a ConfigError
    before any process group is created (pass the model config to check it against the model too).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config is not None:
        dims.validate(config, world)
    elif world != dims.world_size():
        raise ConfigError(f"dp * tp * pp = {dims.world_size()} ranks, but WORLD_SIZE is {world}", field="world_size")
    if world == 1:
        return None
    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return build_mesh(dims, device)
