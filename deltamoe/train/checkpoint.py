"""Training checkpoints with torch.distributed.checkpoint (DCP): model (incl. router-bias
buffers), optimizers, and a small per-rank JSON with the step, data position and RNG state.

Atomicity: every rank writes into `checkpoints/.tmp-step-N`; after a barrier rank 0 renames it
to `checkpoints/step-N`. A rename is atomic, so `latest_checkpoint` only ever sees complete
folders; a crash leaves a `.tmp-*` folder that is ignored and removed by the next save.
DCP reshards on load, so a run saved under one layout can resume under another.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from deltamoe.errors import CheckpointError
from deltamoe.train.optim import Optimizers

_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    data_position: int = 0  # training rows consumed (global)
    tokens: int = 0  # tokens consumed (global)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_dcp():
    """On one process DCP warns that it assumes one process, which is the point: silence that warning
    for the call inside only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp(fn, *args, **kwargs):
    with _single_process_dcp():
        return fn(*args, no_dist=not _distributed(), **kwargs)


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _rng_state() -> dict[str, str]:
    out = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def _set_rng_state(state: dict[str, str]) -> None:
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def _state_dict(parts: list[nn.Module], optimizers: Optimizers) -> dict:
    """One flat DCP state: model FQNs are unique across pipeline parts; optimizers keyed per part."""
    model: dict = {}
    for p in parts:
        model.update(get_model_state_dict(p))
    optim = {f"part{i}": get_optimizer_state_dict(p, o)
             for i, (p, o) in enumerate(zip(parts, optimizers.optimizers))}
    return {"model": model, "optim": optim}


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def save(out: Path, parts: list[nn.Module], optimizers: Optimizers, state: TrainState, keep: int) -> Path:
    root = checkpoint_dir(out)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # saves never overlap: any temp folder is a crashed one
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    _dcp(dcp.save, _state_dict(parts, optimizers), checkpoint_id=str(tmp))
    # RNG differs per rank, so it cannot go through DCP's deduplicated state; JSON, not pickle.
    rank_file = tmp / f"train_state.rank{_rank()}.json"
    rank_file.write_text(json.dumps({**asdict(state), "rng": _rng_state()}))
    _barrier()
    if _rank() == 0:
        if final.exists():  # re-saving a step (e.g. after resuming from it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders of interrupted saves are skipped)."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1] if ckpts else None


def load(path: Path, parts: list[nn.Module], optimizers: Optimizers) -> TrainState:
    """Restore model, optimizers and this rank's RNG in place; return the step and data position."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata)", field="run.resume_from")
    state = _state_dict(parts, optimizers)
    try:
        _dcp(dcp.load, {"model": state["model"]}, checkpoint_id=str(path))
        # Parameters that never received a gradient (e.g. layer 0's AttnRes query, which sees an
        # empty bank) have no AdamW state in the checkpoint but a fresh zero state here: let
        # those keep it. Model tensors above are loaded strictly.
        _dcp(dcp.load, {"optim": state["optim"]}, checkpoint_id=str(path),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    except (RuntimeError, CheckpointException) as e:
        raise CheckpointError(f"{path} does not match this model: {_first_line(e)}", field="run.resume_from") from e
    for p in parts:  # the merged dict holds every part's keys; each part takes its own
        set_model_state_dict(p, state["model"], options=StateDictOptions(strict=len(parts) == 1))
    for i, (p, o) in enumerate(zip(parts, optimizers.optimizers)):
        set_optimizer_state_dict(p, o, state["optim"][f"part{i}"])
    rank_file = path / f"train_state.rank{_rank()}.json"
    if not rank_file.is_file():  # resumed on more ranks than saved: rank 0's counters, fresh RNG
        rank_file = path / "train_state.rank0.json"
    data = json.loads(rank_file.read_text())
    _set_rng_state(data.pop("rng"))
    return TrainState(**data)


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if "Missing key" in ln or "size mismatch" in ln]
    return (lines[0] if lines else str(e).splitlines()[-1]).strip()


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Rank-0 export: load the model entries of a (possibly sharded) checkpoint into a full model."""
    state = {"model": get_model_state_dict(model)}
    with _single_process_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, state["model"])
