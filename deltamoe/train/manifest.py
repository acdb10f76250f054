"""`manifest.json`: the size and SHA-256 of every file of a training checkpoint.

Written by rank 0 after every rank has finished writing (atomically, as the checkpoint's last
file) and verified before anything is loaded, so a flipped byte, a truncated shard or a swapped
file is refused by name instead of resuming into NaN weights. The manifest guards integrity,
not authenticity: whoever can write the folder can rewrite it too (safe_dcp keeps a crafted
checkpoint from running code).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from deltamoe.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Record every file now in `folder`; the manifest appears in one rename."""
    folder = Path(folder)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".tmp-")}
    tmp = folder / f".tmp-{MANIFEST}"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def read_manifest(folder: Path) -> dict[str, dict]:
    """{file name: {"bytes", "sha256"}} of `folder`'s manifest, its shape checked."""
    file = Path(folder) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}, so its files cannot be verified", field=str(file),
                              hint="it was written by an older deltamoe or its save did not finish")
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8
        raise CheckpointError(f"{file} cannot be read: {e}", field=str(file)) from None
    files = data.get("files") if isinstance(data, dict) else None
    ok = (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(files, dict)
          and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                  for v in files.values()))
    if not ok:
        raise CheckpointError(f"{file} is not a format-{FORMAT} manifest", field=str(file))
    return files


def verify_manifest(folder: Path) -> None:
    """Every listed file present with its size and digest, and no file that is not listed."""
    folder = Path(folder)
    files = read_manifest(folder)
    for name, expect in files.items():
        path = folder / name
        if "/" in name or "\\" in name or name in (".", ".."):
            raise CheckpointError(f"{folder / MANIFEST} lists {name!r}, which is not a file of the checkpoint",
                                  field=str(folder / MANIFEST))
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest but missing", field=str(path))
        size = path.stat().st_size
        if size != expect["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {expect['bytes']}", field=str(path),
                                  hint="the checkpoint is truncated or was changed after it was saved")
        if file_digest(path) != expect["sha256"]:
            raise CheckpointError(f"{path} does not match its checksum in the manifest", field=str(path),
                                  hint="the checkpoint is corrupt or was changed after it was saved")
    extra = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in files)
    if extra:
        raise CheckpointError(f"{folder / extra[0]} is not listed in the manifest", field=str(folder / extra[0]),
                              hint="files added after the save are not loaded")
