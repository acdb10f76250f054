"""Parallelism on torch.distributed: FSDP2 data parallel, expert parallel all-to-all, tensor parallel
plans, pipeline stages that never cut an AttnRes block. Entry points: `init_distributed`, `parallelize`."""

from deltamoe.parallel.api import LocalModel, ParallelDims, ParallelModel
from deltamoe.parallel.mesh import init_distributed
from deltamoe.parallel.parallelize import parallelize
from deltamoe.parallel.stage_split import split_stages

__all__ = ["LocalModel", "ParallelDims", "ParallelModel", "init_distributed", "parallelize", "split_stages"]
