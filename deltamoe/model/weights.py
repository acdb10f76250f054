"""Safetensors checkpoint I/O: sharded load with the published names, meta-device init, sharded save.

Loading builds the model on the meta device, materialises empty storage, then copies one
tensor at a time from memory-mapped shards, so peak memory stays near the model plus one
tensor. Every parameter must be written exactly once: a missing, unexpected or mis-shaped
tensor raises CheckpointError naming it (and both shapes). Never unpickles anything.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltamoe.config import ModelConfig
from deltamoe.errors import CheckpointError, ConfigError
from deltamoe.hf_config import config_to_hf, read_json_object
from deltamoe.model.checkpoint_names import TensorTarget, checkpoint_to_param, param_to_checkpoint
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.ops.quant import dequantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: Path) -> dict[str, list[str]]:
    """{shard file: [tensor names]} from the index, or the single file, of a checkpoint folder."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = read_json_object(index, field=str(index)).get("weight_map")
        except ConfigError as e:
            raise CheckpointError(str(e), field=str(index)) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: expected weight_map to be an object of tensor name -> shard file",
                                  field=f"{index}:weight_map")
        shards: dict[str, list[str]] = defaultdict(list)
        for tensor, shard in weight_map.items():
            shards[shard].append(tensor)
        for shard in shards:
            if not is_plain_file_name(shard):
                raise CheckpointError(f"shard {shard!r} named in the index is outside the checkpoint folder",
                                      field=str(index), hint="shards are file names inside the folder")
            if not (path / shard).is_file():
                raise CheckpointError(f"shard {shard} named in the index is missing", field=str(path / shard))
        return dict(shards)
    single = path / SINGLE_FILE
    if single.exists():
        try:
            with safe_open(str(single), "pt") as f:
                return {SINGLE_FILE: list(f.keys())}
        except Exception as e:  # truncated or not a safetensors file
            raise CheckpointError(f"cannot read {single}: {e}", field=str(single)) from e
    raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}", field=str(path),
                          hint="weights are read from safetensors only")


def is_plain_file_name(name: str) -> bool:
    """A name that stays inside its folder: no folder part, not absolute, not `.` / `..`. Symlinks in
    the folder are followed (a hub cache links into its blob store); they were put there by whoever
    made the folder, as the files were."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


class _Loader:
    def __init__(self, model: torch.nn.Module, config: ModelConfig):
        self.config = config
        self.params = dict(model.named_parameters())
        self.params.update(dict(model.named_buffers()))
        self.done: set[str] = set()
        self.experts_done: dict[str, set[int]] = defaultdict(set)
        self.pending_mxfp4: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def put(self, ckpt_name: str, tensor: torch.Tensor) -> None:
        targets = checkpoint_to_param(ckpt_name, self.config)
        if targets is None:
            return
        for t in targets if isinstance(targets, list) else [targets]:
            self._put_one(ckpt_name, t, tensor)

    def _put_one(self, name: str, t: TensorTarget, tensor: torch.Tensor) -> None:
        dest = self.params.get(t.param)
        if dest is None:
            raise CheckpointError(f"unexpected tensor {name} (no parameter {t.param} in this model)", field=name,
                                  hint="does config.json match the weights?")
        if t.expert is not None:
            if not 0 <= t.expert < dest.shape[0]:
                raise CheckpointError(f"expert index {t.expert} out of range (num_experts={dest.shape[0]})", field=name)
            if t.part != "weight":  # MXFP4: wait for both the codes and the scales
                halves = self.pending_mxfp4.setdefault((t.param, t.expert), {})
                halves[t.part] = tensor
                if len(halves) < 2:
                    return
                del self.pending_mxfp4[(t.param, t.expert)]
                try:
                    tensor = dequantize_mxfp4(halves["weight_packed"], halves["weight_scale"], dtype=torch.float32)
                except ValueError as e:
                    raise CheckpointError(f"bad MXFP4 expert tensor: {e}", field=name) from e
            self._copy(name, dest[t.expert], tensor)
            self.experts_done[t.param].add(t.expert)
            return
        if t.kind == "a_log":
            h = dest.shape[0]
            flat = tensor.reshape(-1)
            if flat.numel() < h or bool((flat[h:] != 0).any()):
                raise CheckpointError(f"A_log has {flat.numel()} values, expected {h} (or zero-padded beyond)",
                                      field=name)
            tensor = flat[:h]
        elif t.kind == "split_conv":
            tensor = tensor.chunk(3, dim=0)[t.split_index]
        elif t.kind == "split_gate_up":
            tensor = tensor.chunk(2, dim=1)[t.split_index]
        self._copy(name, dest, tensor)
        self.done.add(t.param)

    @staticmethod
    def _copy(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(src.shape) != tuple(dest.shape):
            raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(src.shape)}, model {tuple(dest.shape)}",
                                  field=name)
        with torch.no_grad():
            dest.copy_(src.to(dest.dtype))

    def check_complete(self, tied: set[str]) -> None:
        if self.pending_mxfp4:
            (param, e), halves = next(iter(self.pending_mxfp4.items()))
            missing = {"weight_packed", "weight_scale"} - set(halves)
            raise CheckpointError(f"MXFP4 expert {e} of {param} lacks {sorted(missing)}", field=f"{param}.{e}")
        for name, p in self.params.items():
            if name in tied:
                continue
            if ".experts.w" in name:
                missing = sorted(set(range(p.shape[0])) - self.experts_done[name])
                if missing:
                    ck = param_to_checkpoint(name, self.config)
                    first = ck[missing[0]] if isinstance(ck, list) else ck
                    raise CheckpointError(f"missing tensor {first} ({len(missing)} experts missing)", field=first)
            elif name not in self.done:
                ck = param_to_checkpoint(name, self.config)
                raise CheckpointError(f"missing tensor {ck} (for parameter {name})", field=str(ck))


def load_weights(model: DeltaMoEForCausalLM, path: str | Path) -> None:
    """Fill every parameter of `model` from the safetensors checkpoint folder `path`, shard by shard."""
    path = Path(path)
    loader = _Loader(model, model.config)
    for shard, names in checkpoint_files(path).items():
        try:
            with safe_open(str(path / shard), "pt", device="cpu") as f:
                for name in names:
                    loader.put(name, f.get_tensor(name))
        except CheckpointError:
            raise
        except Exception as e:  # a truncated or corrupt shard
            raise CheckpointError(f"cannot read {path / shard}: {e}", field=str(path / shard)) from e
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    loader.check_complete(tied)


def state_dict_for_checkpoint(model: DeltaMoEForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under their published names (experts split per expert)."""
    config = model.config
    out: dict[str, torch.Tensor] = {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, t in tensors.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        target = param_to_checkpoint(name, config)
        if isinstance(target, list):
            for e, ck in enumerate(target):
                out[ck] = t[e].detach().contiguous()
        else:
            if name.endswith("self_attn.A_log") and config.model_type == "kimi_linear":
                t = t.reshape(1, 1, -1, 1)
            out[target] = t.detach().contiguous()
    return out


def save_checkpoint(model: DeltaMoEForCausalLM, path: str | Path, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write config.json + sharded safetensors + index in the published layout; every file atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_for_checkpoint(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tmp = path / f".{fname}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / fname)
        weight_map.update({k: fname for k in shard})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json_atomic(path / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(path / "config.json", config_to_hf(model.config))


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
