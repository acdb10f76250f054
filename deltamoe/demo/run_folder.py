"""The demo's run folder: where each stage writes, what an earlier run left there, and how files
appear only when complete.

    runs/demo/
      train/           the trainer's run folder: DCP checkpoints (resume), metrics.jsonl,
                       eval.jsonl, curves.png, traces/rank0.json
      checkpoint/      the final weights (config.json + model.safetensors); it appears in one
                       rename once training has finished, so it is either complete or absent
      results.json     one section per finished stage, rewritten after each stage
      plans/           per hardware: the full plan tables (.txt) and the plan JSON
      trace-report.json

Nothing here is written in place: files go to a temporary name and are renamed, so a Ctrl-C at
any moment leaves the previous version or nothing, never half a file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from deltamoe.model.weights import write_json_atomic
from deltamoe.trace.report import atomic_write

# Everything the demo may create; `clear` (--fresh) removes these and nothing else.
OWNED = ("train", "checkpoint", ".checkpoint.tmp", "results.json", "plans", "trace-report.json")


class RunFolder:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.train = self.root / "train"
        self.checkpoint = self.root / "checkpoint"
        self.results = self.root / "results.json"
        self.plans = self.root / "plans"
        self.trace_report = self.root / "trace-report.json"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def has_checkpoint(self) -> bool:
        """A finished run's weights are here (the folder only ever appears complete)."""
        return (self.checkpoint / "config.json").is_file() and any(self.checkpoint.glob("*.safetensors"))

    def has_traces(self) -> bool:
        return any((self.train / "traces").glob("rank*.json*"))

    def clear(self) -> None:
        """--fresh: forget every earlier result in this folder (only the demo's own files)."""
        for name in OWNED:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def publish_checkpoint(self, exported: Path) -> None:
        """Move a complete exported weights folder into place in one rename (same file system)."""
        staged = self.root / ".checkpoint.tmp"
        if staged.exists():
            shutil.rmtree(staged)
        os.replace(exported, staged)
        if self.checkpoint.exists():  # only after a crash between the two renames below
            shutil.rmtree(self.checkpoint)
        os.replace(staged, self.checkpoint)

    # ------------------------------------------------------------------ results.json
    def read_results(self) -> dict[str, Any]:
        try:
            data = json.loads(self.results.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save_results(self, results: dict[str, Any]) -> None:
        """Rewrite results.json with this run's sections so far (called after each stage)."""
        write_json_atomic(self.results, results)

    def write_text(self, relative: str, text: str) -> Path:
        path = self.root / relative
        atomic_write(path, text.encode())
        return path

    def write_json(self, relative: str, data: Any) -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
        return path
