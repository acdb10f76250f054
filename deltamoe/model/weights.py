"""Safetensors checkpoint I/O: sharded load with the published names, meta-device init, sharded save.

Loading builds the model on the meta device, materialises empty storage, then copies one
tensor at a time from memory-mapped shards, so peak memory stays near the model plus one
tensor. Every parameter must be written exactly once: a missing, unexpected or mis-shaped
tensor raises CheckpointError naming it (and both shapes). Never unpickles anything.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltamoe.config import ModelConfig
from deltamoe.errors import CheckpointError, ConfigError
from deltamoe.hf_config import config_to_hf, read_json_object
from deltamoe.model.checkpoint_names import TensorTarget, checkpoint_to_param, param_to_checkpoint, text_prefix
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.model.quant_scheme import PARTS, QuantScheme, dequantize_weight, make_scheme, scheme_from_config
from deltamoe.model.quantized_linear import Int4Linear

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # what save_tensors names shards


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


# Expert tensors split into `weight_packed` + `weight_scale` with no quantization_config are MXFP4 (K3's).
_DEFAULT_EXPERT_SCHEME = make_scheme("mxfp4")


@dataclass(frozen=True)
class Chunk:
    """The part of a full tensor that one process holds: piece `index` of `full.chunk(count, dim)`."""

    dim: int
    index: int
    count: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.count, self.dim)[self.index]

    def span(self, size: int) -> range:
        """The indices along `dim` (of full size `size`) that this piece holds (torch.chunk's split)."""
        step = -(-size // self.count)
        return range(min(self.index * step, size), min((self.index + 1) * step, size))


@dataclass
class ShardLayout:
    """What a sharded model (a serving rank's) holds of each full checkpoint tensor: parameters in
    `chunks` hold that piece (routed experts: a range of experts along dim 0), the others all of it.
    `full_shapes` are the whole model's shapes, which the checkpoint's tensors are checked against."""

    full_shapes: dict[str, tuple[int, ...]]
    chunks: dict[str, Chunk] = field(default_factory=dict)


class _Loader:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, scheme: QuantScheme | None = None,
                 layout: ShardLayout | None = None):
        self.config = config
        self.scheme = scheme
        self.params = dict(model.named_parameters())
        self.params.update(dict(model.named_buffers()))
        # A sharded model's DTensor parameters (expert-parallel experts) are written through their local part.
        self.params = {n: p.detach().to_local() if hasattr(p, "to_local") else p for n, p in self.params.items()}
        self.layout = layout or ShardLayout({n: tuple(p.shape) for n, p in self.params.items()})
        # Modules that keep their weights quantized take the published tensors themselves.
        self.quantized = {n: m for n, m in model.named_modules() if isinstance(m, (Int4Linear, PackedExperts))}
        self.done: set[str] = set()
        self.experts_done: dict[str, set[int]] = defaultdict(set)
        # Quantized tensors of a float model, held until all parts of one weight are here to dequantise.
        self.pending: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}

    def wants(self, ckpt_name: str) -> bool:
        """Whether this model holds any of the tensor (a sharded one skips other ranks' experts unread)."""
        targets = checkpoint_to_param(ckpt_name, self.config)
        if targets is None:
            return False
        return any(self._holds_expert(t) for t in (targets if isinstance(targets, list) else [targets]))

    def _holds_expert(self, t: TensorTarget) -> bool:
        chunk = self.layout.chunks.get(t.param)
        if t.expert is None or chunk is None:
            return True
        full = self.layout.full_shapes.get(t.param)
        return full is None or t.expert in chunk.span(full[0]) or not 0 <= t.expert < full[0]  # out of range: an error

    def read(self, f, ckpt_name: str) -> None:
        """Read one wanted tensor from the open file `f` into the model. A tensor that lands whole in
        one parameter of which this rank holds a piece (a TP shard) is read as that piece only."""
        t = checkpoint_to_param(ckpt_name, self.config)
        chunk = self.layout.chunks.get(t.param) if isinstance(t, TensorTarget) else None
        if (chunk is None or t.kind != "copy" or t.expert is not None or t.part != "weight"
                or t.param.rpartition(".")[0] in self.quantized):
            self.put(ckpt_name, f.get_tensor(ckpt_name))
            return
        piece = f.get_slice(ckpt_name)
        shape = tuple(piece.get_shape())
        if shape != tuple(self.layout.full_shapes[t.param]):
            raise CheckpointError(f"shape mismatch for {ckpt_name}: checkpoint {shape}, model "
                                  f"{tuple(self.layout.full_shapes[t.param])}", field=ckpt_name)
        span = chunk.span(shape[chunk.dim])
        index = tuple(slice(span.start, span.stop) if d == chunk.dim else slice(None) for d in range(len(shape)))
        tensor = piece[index]
        check_finite(ckpt_name, tensor)  # this rank's piece: another rank checks the rest
        self._put_one(ckpt_name, t, tensor, local=True)

    def put(self, ckpt_name: str, tensor: torch.Tensor) -> None:
        targets = checkpoint_to_param(ckpt_name, self.config)
        if targets is None:
            return
        check_finite(ckpt_name, tensor)
        for t in targets if isinstance(targets, list) else [targets]:
            if self._holds_expert(t):
                self._put_one(ckpt_name, t, tensor)

    def _put_one(self, name: str, t: TensorTarget, tensor: torch.Tensor, local: bool = False) -> None:
        """`local`: `tensor` is already this rank's piece of the parameter (read as a slice)."""
        module, _, leaf = t.param.rpartition(".")
        owner = self.quantized.get(module)
        if owner is not None:
            if t.expert is not None:
                owner.load_part(name, leaf, t.expert, t.part, tensor)
            else:
                owner.load_part(name, leaf, tensor)
            return
        if t.expert is None and self.scheme is not None and leaf in PARTS["int4"]:
            tensor = self._gather_parts(name, module + ".weight", None, leaf, tensor)
            if tensor is None:
                return
            t = TensorTarget(module + ".weight")
        dest = self.params.get(t.param)
        if dest is None:
            raise CheckpointError(f"unexpected tensor {name} (no parameter {t.param} in this model)", field=name,
                                  hint="does config.json match the weights?")
        if t.expert is not None:
            full = self.layout.full_shapes[t.param]
            if not 0 <= t.expert < full[0]:
                raise CheckpointError(f"expert index {t.expert} out of range (num_experts={full[0]})", field=name)
            if t.part != "weight":  # quantized: wait for all parts (codes, scales, shape), then dequantise
                tensor = self._gather_parts(name, t.param, t.expert, t.part, tensor)
                if tensor is None:
                    return
            chunk = self.layout.chunks.get(t.param)
            row = t.expert - (chunk.span(full[0]).start if chunk is not None else 0)
            self._copy(name, dest[row], tensor)
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
        chunk = self.layout.chunks.get(t.param)
        if chunk is not None and not local:  # a sharded model: check the whole tensor, keep this rank's piece
            self._check_shape(name, tensor, self.layout.full_shapes[t.param])
            tensor = chunk.of(tensor)
        self._copy(name, dest, tensor)
        self.done.add(t.param)

    def _gather_parts(self, name: str, param: str, expert: int | None, part: str, tensor: torch.Tensor
                      ) -> torch.Tensor | None:
        """Collect one quantized weight's parts; the fp32 weight once the last arrives, else None."""
        scheme = self.scheme or _DEFAULT_EXPERT_SCHEME
        parts = self.pending.setdefault((param, expert), {})
        parts[part] = tensor
        if len(parts) < len(PARTS[scheme.weight_format]):
            return None
        del self.pending[(param, expert)]
        return dequantize_weight(scheme, name, parts)

    @staticmethod
    def _check_shape(name: str, src: torch.Tensor, full: tuple[int, ...]) -> None:
        if tuple(src.shape) != tuple(full):
            raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(src.shape)}, model {tuple(full)}",
                                  field=name)

    @classmethod
    def _copy(cls, name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
        cls._check_shape(name, src, tuple(dest.shape))
        with torch.no_grad():
            dest.copy_(src.to(dest.dtype))

    def check_complete(self, tied: set[str]) -> None:
        if self.pending:
            (param, e), parts = next(iter(self.pending.items()))
            fmt = (self.scheme or _DEFAULT_EXPERT_SCHEME).weight_format
            missing = set(PARTS[fmt]) - set(parts)
            what = f"{fmt.upper()} expert {e} of {param}" if e is not None else f"{fmt.upper()} weight {param}"
            raise CheckpointError(f"{what} lacks {sorted(missing)}", field=param if e is None else f"{param}.{e}")
        for name, m in self.quantized.items():
            if isinstance(m, Int4Linear) and not m.is_loaded and ".experts." not in name:
                ck = param_to_checkpoint(name + ".weight_packed", self.config)
                raise CheckpointError(f"missing tensor {ck} (or its weight_scale / weight_shape)", field=str(ck))
            if isinstance(m, PackedExperts) and m.missing() is not None:
                ck = f"{text_prefix(self.config)}{name}.{m.missing()}"
                raise CheckpointError(f"missing tensor {ck}", field=ck)
        for name, p in self.params.items():
            if name in tied:
                continue
            if ".experts.w" in name:
                full, chunk = self.layout.full_shapes[name], self.layout.chunks.get(name)
                held = chunk.span(full[0]) if chunk is not None else range(full[0])
                missing = sorted(set(held) - self.experts_done[name])
                if missing:
                    ck = param_to_checkpoint(name, self.config)
                    first = ck[missing[0]] if isinstance(ck, list) else ck
                    raise CheckpointError(f"missing tensor {first} ({len(missing)} experts missing)", field=first)
            elif name not in self.done:
                ck = param_to_checkpoint(name, self.config)
                raise CheckpointError(f"missing tensor {ck} (for parameter {name})", field=str(ck))


# The dtypes whose values are checked: torch's CPU reductions do not take fp8 / fp4 (a checkpoint
# may store some weights so), and integer codes have no NaN.
_CHECKED_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in `tensor` (fp16/bf16/fp32/fp64; others pass). One min/max pass, which NaN
    propagates through: ~40x cheaper than `isfinite(t).all()`, which materialises a mask."""
    if tensor.dtype not in _CHECKED_FLOATS or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """A float tensor holding NaN or inf is a CheckpointError naming it: such weights decoded NaN
    logits (a traceback when sampling, a row of token 0 when greedy) instead of failing at load."""
    if not all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"tensor {name} holds {bad} non-finite value(s) (NaN or inf)", field=name,
                              hint="the checkpoint is corrupt, or was saved from a run that diverged")


def load_weights(model: DeltaMoEForCausalLM, path: str | Path, scheme: QuantScheme | None = None,
                 layout: ShardLayout | None = None) -> None:
    """Fill every parameter of `model` from the safetensors checkpoint folder `path`, shard by shard.

    `scheme` is the checkpoint's quantization (`read_quant_scheme`): modules swapped by
    `quantize_modules` take its tensors as they are, float modules get them dequantised.
    `layout`: `model` is one rank's shard holding these parts of the full tensors; tensors it holds
    none of (other ranks' experts) are not read, nor are files holding only such tensors, and a
    TP-split tensor is read as this rank's piece (safetensors slices)."""
    path = Path(path)
    loader = _Loader(model, model.config, scheme, layout)
    for shard, names in checkpoint_files(path).items():
        wanted = [name for name in names if loader.wants(name)]
        if not wanted:
            continue
        try:
            with safe_open(str(path / shard), "pt", device="cpu") as f:
                for name in wanted:
                    loader.read(f, name)
        except CheckpointError:
            raise
        except Exception as e:  # a truncated or corrupt shard
            raise CheckpointError(f"cannot read {path / shard}: {e}", field=str(path / shard)) from e
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    loader.check_complete(tied)


def state_dict_for_checkpoint(model: DeltaMoEForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under their published names (experts split per expert)."""
    config = model.config
    if any(isinstance(m, (Int4Linear, PackedExperts)) for m in model.modules()):
        raise CheckpointError("a model loaded quantized holds its weights in kernel layouts and is not saved",
                              field="model", hint="load with dequantize=True to save a float copy, or run "
                                                  "`deltamoe quantize` on the float checkpoint")
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
    save_tensors(state_dict_for_checkpoint(model), path, config_to_hf(model.config), max_shard_bytes)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, config_json: dict,
                 max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write published-name tensors as sharded safetensors (+ index when sharded) and config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
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
    names = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # A checkpoint already in `path` (a re-export, or another one) must not outlive this one in part:
    # its index would point a loader at its shards. The index goes first, so a write cut short leaves
    # a folder that fails to load, never one that mixes two checkpoints; its other files go at the end.
    stale = [p for p in path.glob("model*.safetensors") if p.name not in names
             and (p.name == SINGLE_FILE or SHARD_NAME.fullmatch(p.name))]
    if n == 1 and (path / INDEX_FILE).exists():
        (path / INDEX_FILE).unlink()
    weight_map: dict[str, str] = {}
    mode = _new_file_mode(path)
    for fname, shard in zip(names, shards):
        tmp = path / f".{fname}.tmp"
        try:
            save_file(shard, str(tmp), metadata={"format": "pt"})
            os.chmod(tmp, mode)  # safetensors creates it 0600; a checkpoint is shared like its config.json
            os.replace(tmp, path / fname)
        except BaseException:  # Ctrl-C or a full disk: no hidden shard-sized file left behind
            tmp.unlink(missing_ok=True)
            raise
        weight_map.update({k: fname for k in shard})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json_atomic(path / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(path / "config.json", config_json)
    for p in stale:
        p.unlink(missing_ok=True)


def read_quant_scheme(path: str | Path) -> QuantScheme | None:
    """The checkpoint's `quantization_config` (config.json) as a QuantScheme; None when it has none."""
    config_file = Path(path) / "config.json"
    try:
        qc = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {config_file}: {e}", field=str(config_file)) from e
    return None if qc is None else scheme_from_config(qc)


def _new_file_mode(folder: Path) -> int:
    """The mode open() gives a new file in `folder` (0644 under the usual umask 022), read off a probe
    file: reading the umask means setting it, which races with other threads creating files."""
    probe = folder / f".mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o666)
    os.close(fd)
    try:
        return os.stat(probe).st_mode & 0o777
    finally:
        probe.unlink()


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
