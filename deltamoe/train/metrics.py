"""jsonl logs of a run: appended one flushed line per record, truncated atomically on resume.
(Whole JSON files go through `deltamoe.model.weights.write_json_atomic`.)"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; a diverged loss is logged as null rather than breaking the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLog:
    """Append-only, one JSON object per line, flushed so a crash loses at most the line in flight."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line from a crash
            break
    return out


def truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume: keep records up to `last_step`, dropping what the interrupted run logged after
    its checkpoint, so the file reads as one uninterrupted run. Rewritten atomically."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
