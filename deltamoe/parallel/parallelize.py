"""`parallelize(model, dims, mesh)`: apply the parallelisms in torchtitan order and return the ParallelModel."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from deltamoe.errors import ConfigError
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.api import LocalModel, ParallelDims, ParallelModel


def parallelize(model: DeltaMoEForCausalLM, dims: ParallelDims, mesh: DeviceMesh | None) -> ParallelModel:
    dims.validate(model.config, 1 if mesh is None else mesh.size())
    if mesh is None:
        return LocalModel(model)
    raise ConfigError("distributed layouts are being wired up", field="dims")
