"""A serving rank's shard read straight from the checkpoint, never the whole model.

Loading the full model on every rank and then keeping a part (what the plans do to a model they are
given) needs each rank to hold all the weights once: for Kimi K3 (2.8 T parameters, ~97 % of them
routed experts) no rank can. Here the model is built on the meta device, the serving plans
(`sharding.shard_for_serving`) shard it there, storage is made for the shard only, and the
checkpoint is read into it: a tensor of other ranks' experts is never read, nor a file holding only
such tensors; of a TP-sharded tensor only this rank's piece is read (a safetensors slice).
The result equals `shard_for_serving(load_model(...))` (the weights and the modules).

A preset (random weights from a seed) is still made whole and then cut: every rank must draw the
same numbers, and presets are for small models.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltamoe.hf_config import load_config
from deltamoe.model.int4_projection_group import join_shared_input_projections
from deltamoe.model.load import load_model, materialize, quantized_skeleton
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.model.weights import Chunk, ShardLayout, checkpoint_files, load_weights, read_quant_scheme
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.serve.executor.sharding import shard_for_serving
from deltamoe.serve.executor.weight_sync import part_of, tp_coordinate


def load_shard(source: str | Path, dtype: torch.dtype, device: str, dims: ParallelDims,
               mesh: ParallelMesh) -> DeltaMoEForCausalLM:
    """This rank's shard of the model at `source` (a checkpoint folder, or a preset name)."""
    path = Path(source)
    if not path.is_dir():
        return shard_for_serving(load_model(source, dtype=dtype, device=device), dims, mesh)
    checkpoint_files(path)  # fail early, naming the folder, when there are no weights
    scheme = read_quant_scheme(path)
    config = load_config(path)
    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    if scheme is not None:  # packed modules, cut to this rank's experts below before anything loads
        quantized_skeleton(model, scheme, device)
    full_shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    shard_for_serving(model, dims, mesh)
    materialize(model, dtype, device)
    tp_rank = tp_coordinate(mesh, dims.tp)
    layout = ShardLayout(full_shapes)
    for name, target in model.state_dict(keep_vars=True).items():
        chunk = part_of(name, target, full_shapes[name], tp_rank, dims.tp)
        if chunk is not None:
            layout.chunks[name] = chunk
    if dims.ep > 1:  # packed experts hold no parameters: their share is named for the loader here
        ep_rank = mesh["ep"].get_local_rank()
        for name, module in model.named_modules():
            if isinstance(module, PackedExperts):
                for proj in ("w1", "w3", "w2"):
                    layout.full_shapes[f"{name}.{proj}"] = (config.num_experts,)
                    layout.chunks[f"{name}.{proj}"] = Chunk(0, ep_rank, dims.ep)
    load_weights(model, path, scheme, layout=layout)
    if scheme is not None:
        join_shared_input_projections(model)
    if config.tie_word_embeddings:
        # Both are split by vocabulary rows alike (or not at all), so the rank's rows are the same.
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
