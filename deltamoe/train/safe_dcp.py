"""Reading torch.distributed.checkpoint (DCP) folders without running code planted in them.

DCP pickles two things: the `.metadata` index (read with plain `pickle.load`) and the non-tensor
entries of a state dict such as optimizer hyperparameters (read with `torch.load(weights_only=False)`).
Either would execute a `__reduce__` payload in a crafted checkpoint. Here:

- `SafeFileSystemReader` unpickles `.metadata` with `MetadataUnpickler`, whose `find_class` admits
  only the types a DCP index holds (its dataclasses, torch.Size, dtypes and layouts, a path), and
  checks that every storage entry names a plain `.distcp` file inside the checkpoint folder,
  without stream transforms;
- `SafeLoadPlanner` reads the non-tensor entries with `torch.load(weights_only=True)`, torch's own
  restricted unpickler (tensors are already read that way by DCP).

Anything else raises CheckpointError naming the file, before a single tensor is read.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from deltamoe.errors import CheckpointError

# A shard file written by DCP's FileSystemWriter: `__<rank>_<n>.distcp`; nothing with a folder part.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.distcp$")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for every global a DCP `.metadata` pickle may name."""
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a name -> torch.layout lookup
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("pathlib", "PosixPath"): Path,  # StorageMeta.checkpoint_id; pickled as its parts
        ("pathlib", "PurePosixPath"): PurePosixPath,
    }
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "ChunkStorageMetadata",
                 "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
    for name, value in vars(torch).items():  # dtypes pickle as plain globals (torch.float32, ...)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED = _allowed_globals()


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP index; any other global (os.system, builtins.eval, ...) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name}") from None


def read_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """The DCP index of checkpoint folder `path`, read without executing anything it names."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}", field=str(file)) from None
    except Exception as e:  # UnpicklingError, EOFError, a bad opcode, a constructor refusing its arguments
        raise CheckpointError(f"{file} is not a DCP checkpoint index ({type(e).__name__}: {_short(e)})",
                              field=str(file), hint="checkpoints are only read, never executed; "
                              "this one is corrupt or was crafted") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file} is not a DCP checkpoint index (holds {type(metadata).__name__})",
                              field=str(file))
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointError(f"{file} has a malformed storage entry", field=str(file))
        if not _SHARD_NAME.match(info.relative_path) or info.relative_path in (".", ".."):
            raise CheckpointError(f"{file} names shard {info.relative_path!r} outside the checkpoint folder",
                                  field=str(file))
        if info.transform_descriptors:
            raise CheckpointError(f"{file} asks for stream transforms {list(info.transform_descriptors)}; "
                                  "only plain shards are read", field=str(file))
    return metadata


def _short(e: Exception, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through `read_dcp_metadata`."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._folder = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are a layout we never write
            raise CheckpointError("per-rank DCP metadata is not supported", field=str(self._folder))
        metadata = read_dcp_metadata(self._folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"entry {read_item.dest_index.fqn} is not plain data ({_short(e)})",
                                  field=read_item.dest_index.fqn) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
