"""Checking that a command can write where it was told to, before it spends time computing.

An output folder that is a file, sits under /proc, or cannot be written, and a report path whose
folder cannot be written, become one error naming the option, not a traceback at the end of a run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from deltamoe.errors import ConfigError, DeltaMoEError


def check_output_folder(path: str | Path, field: str, error: type[DeltaMoEError] = ConfigError) -> Path:
    """Create folder `path` if needed and prove it writable by writing (and removing) a probe file."""
    if not str(path).strip():  # Path("") is the working directory: never meant
        raise error("empty path", field=field, hint="name the folder to write to")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise error(f"{path} exists and is not a folder", field=field)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise error(f"cannot write into {path}: {e.strerror or e}", field=field) from None
    return path


def check_output_file(path: str | Path, field: str, error: type[DeltaMoEError] = ConfigError) -> Path:
    """A file path that can be written: not a folder, in a folder that exists (or can be made) and is writable."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path} is a folder; expected a file name", field=field)
    check_output_folder(path.parent, field, error)
    return path
