"""Training checkpoints with torch.distributed.checkpoint (DCP): model (incl. router-bias
buffers), optimizers, and a small per-rank JSON with the step, data position and RNG state.

Atomicity: every rank writes into `checkpoints/.tmp-step-N`; after a barrier rank 0 renames it
to `checkpoints/step-N`. A rename is atomic, so `latest_checkpoint` only ever sees complete
folders; a crash leaves a `.tmp-*` folder that is ignored and removed by the next save.
DCP reshards on load, so a run saved under one layout can resume under another.

Integrity and safety: rank 0 writes `manifest.json` (size and SHA-256 of every file) last, and
`load` verifies it before reading anything; the DCP index and non-tensor entries are read
through `safe_dcp`, which never executes what a checkpoint names. Each checkpoint also holds the
`train_config.json` it was trained with, which resume compares against (resume_check).
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from deltamoe.errors import ConfigError, CheckpointError
from deltamoe.train.manifest import verify_manifest, write_manifest
from deltamoe.train.optim import Optimizers
from deltamoe.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata

_NAME = re.compile(r"^step-(\d+)$")
CONFIG_FILE = "train_config.json"  # the run's TrainConfig, as saved with each checkpoint


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


def save(out: Path, parts: list[nn.Module], optimizers: Optimizers, state: TrainState, keep: int,
         config: dict | None = None) -> Path:
    """Write checkpoint `step-N` (with `config`, the run's TrainConfig as a dict, when given)."""
    root = checkpoint_dir(out)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # saves never overlap: any temp folder is a crashed one
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    try:
        _save_dcp(parts, optimizers, tmp)
        # RNG differs per rank, so it cannot go through DCP's deduplicated state; JSON, not pickle.
        rank_file = tmp / f"train_state.rank{_rank()}.json"
        rank_file.write_text(json.dumps({**asdict(state), "rng": _rng_state()}))
        if config is not None and _rank() == 0:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    except KeyboardInterrupt:
        if _rank() == 0:  # the checkpoints before this one are complete; this one never was
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank() == 0:
        write_manifest(tmp)  # last: every rank's files are complete
        if final.exists():  # re-saving a step (e.g. after resuming from it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _save_dcp(parts: list[nn.Module], optimizers: Optimizers, tmp: Path) -> None:
    """dcp.save, with a Ctrl-C that DCP caught and wrapped (a CheckpointException) a KeyboardInterrupt again."""
    try:
        _dcp(dcp.save, _state_dict(parts, optimizers), checkpoint_id=str(tmp))
    except CheckpointException as e:
        if any(isinstance(failure[0], KeyboardInterrupt) for failure in e.failures.values()):
            raise KeyboardInterrupt from None
        raise


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders of interrupted saves are skipped)."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says (`step-N`), None for another name."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def check_no_later_checkpoints(out: Path, start_step: int, resuming: bool, field: str = "run.out") -> None:
    """Refuse a run whose `out` holds checkpoints past the step it starts from: its saves would sort
    before them, so pruning would delete its own newest ones, and `--resume`, the NaN stop's "last
    good checkpoint" and the multi-rank export (all `latest_checkpoint`) would read the other run."""
    later = [p for p in list_checkpoints(out) if (step_of(p) or 0) > start_step]
    if not later:
        return
    names = ", ".join(p.name for p in later[-3:]) + (f" and {len(later) - 3} more" if len(later) > 3 else "")
    if not resuming:
        raise ConfigError(f"{checkpoint_dir(out)} holds checkpoints of an earlier run ({names}); a new run there "
                          "would prune its own saves and resume or export the older run's", field=field,
                          hint="pass --resume to continue that run, or another --out, or remove its checkpoints folder")
    raise ConfigError(f"{checkpoint_dir(out)} holds {names}, past step {start_step} this run resumes from; its "
                      "saves would be pruned in their favour", field=field,
                      hint="remove the later checkpoints, or pass another --out")


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1] if ckpts else None


def load(path: Path, parts: list[nn.Module], optimizers: Optimizers, verified: bool = False) -> TrainState:
    """Restore model, optimizers and this rank's RNG in place; return the step and data position.
    The folder's manifest is verified and its index read safely before any tensor is loaded
    (`verified`: the caller has just run `check_loadable`)."""
    path = Path(path)
    if not verified:
        check_loadable(path)
    state = _state_dict(parts, optimizers)
    try:
        _dcp(dcp.load, {"model": state["model"]}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        # Parameters that never received a gradient (e.g. layer 0's AttnRes query, which sees an
        # empty bank) have no AdamW state in the checkpoint but a fresh zero state here: let
        # those keep it. Model tensors above are loaded strictly.
        _dcp(dcp.load, {"optim": state["optim"]}, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner(allow_partial_load=True))
    except CheckpointException as e:
        raise dcp_error(e, path, "run.resume_from") from None
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not match this model: {_first_line(e)}", field="run.resume_from") from e
    for p in parts:  # the merged dict holds every part's keys; each part takes its own
        set_model_state_dict(p, state["model"], options=StateDictOptions(strict=len(parts) == 1))
    for i, (p, o) in enumerate(zip(parts, optimizers.optimizers)):
        set_optimizer_state_dict(p, o, state["optim"][f"part{i}"])
    rank_file = path / f"train_state.rank{_rank()}.json"
    if not rank_file.is_file():  # resumed on more ranks than saved: rank 0's counters, fresh RNG
        rank_file = path / "train_state.rank0.json"
    train_state, rng = read_train_state(rank_file)
    try:
        _set_rng_state(rng)
    except RuntimeError as e:  # a state of the wrong length
        raise CheckpointError(f"{rank_file}: rng state does not fit this torch ({_first_line(e)})",
                              field=str(rank_file)) from None
    return train_state


def load_optimizer_state(path: Path, parts: list[nn.Module], optimizers: Optimizers, field: str) -> int:
    """Only the optimizers' per-parameter state (AdamW's moments and step count) of checkpoint `path`,
    into `optimizers`; their hyperparameters (lr, betas, weight decay) stay as built. Returns the
    checkpoint's step. `field` names the setting that chose `path`, for errors."""
    path = Path(path)
    check_loadable(path, field)
    optim = _state_dict(parts, optimizers)["optim"]
    try:
        _dcp(dcp.load, {"optim": optim}, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner(allow_partial_load=True))
    except CheckpointException as e:
        raise dcp_error(e, path, field) from None
    for i, (p, o) in enumerate(zip(parts, optimizers.optimizers)):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
        set_optimizer_state_dict(p, o, optim[f"part{i}"])
        for g, kept in zip(o.param_groups, groups):
            g.update(kept)
    train_state, _ = read_train_state(path / "train_state.rank0.json")
    return train_state.step


def check_loadable(path: Path, field: str = "run.resume_from") -> None:
    """A complete checkpoint whose files match their manifest and whose DCP index is plain data."""
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata)", field=field)
    try:
        verify_manifest(path)
        read_dcp_metadata(path)
    except CheckpointError as e:  # name the setting that chose the checkpoint; the message names the file
        raise CheckpointError(str(e), field=field, hint=e.hint) from None


def read_train_state(file: Path) -> tuple[TrainState, dict[str, str]]:
    """The counters and RNG state of one rank's `train_state.rank*.json`, every field checked."""
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}", field=str(file)) from None
    names = {"step", "data_position", "tokens"}
    ok = (isinstance(data, dict) and set(data) == names | {"rng"}
          and all(isinstance(data[k], int) and not isinstance(data[k], bool) and data[k] >= 0 for k in names)
          and isinstance(data["rng"], dict) and isinstance(data["rng"].get("cpu"), str)
          and all(isinstance(v, str) for v in data["rng"].values()))
    if not ok:
        raise CheckpointError(f"{file} is not a train state (expected non-negative integers {sorted(names)} "
                              "and an rng table)", field=str(file))
    rng = data.pop("rng")
    try:
        for v in rng.values():
            base64.b64decode(v, validate=True)
    except ValueError as e:
        raise CheckpointError(f"{file}: rng state is not base64 ({e})", field=str(file)) from None
    return TrainState(**data), rng


def read_saved_config(path: Path) -> dict | None:
    """The TrainConfig dict saved with checkpoint `path` (verified by its manifest); None if it has none."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}", field=str(file)) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a table of sections", field=str(file))
    return data


def dcp_error(e: CheckpointException, path: Path, field: str) -> CheckpointError:
    """One error for a failed DCP load, which wraps every rank's exception with its traceback: a
    CheckpointError that safe_dcp raised passes through; a model mismatch says so; anything else
    (an index pointing at the wrong bytes) names the checkpoint and the first line of the cause."""
    for failure in e.failures.values():
        inner = failure[0] if isinstance(failure, tuple) and failure else None
        if isinstance(inner, CheckpointError):
            return inner
    if "Missing key" in str(e) or "size mismatch" in str(e):
        return CheckpointError(f"{path} does not match this model: {_first_line(e)}", field=field)
    inner = next((f[0] for f in e.failures.values() if isinstance(f, tuple) and f), e)
    # The first sentence: torch's own advice after it (retry with weights_only=False) is the wrong one here.
    first = next((ln.strip() for ln in str(inner).splitlines() if ln.strip()), "").split(". ")[0]
    return CheckpointError(f"{path} cannot be loaded ({type(inner).__name__}: {first})", field=field,
                           hint="its index and shards do not agree; the checkpoint is damaged or was crafted")


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if "Missing key" in ln or "size mismatch" in ln]
    return (lines[0] if lines else str(e).splitlines()[-1]).strip()


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Rank-0 export: load the model entries of a (possibly sharded) checkpoint into a full model."""
    path = Path(path)
    check_loadable(path)
    state = {"model": get_model_state_dict(model)}
    with _single_process_dcp():
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise dcp_error(e, path, str(path)) from None
    set_model_state_dict(model, state["model"])
