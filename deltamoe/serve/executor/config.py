"""WorkerConfig: how many ranks one serving replica spans (`--tp`, `--ep`), checked before torch loads.

The layout is the training stack's `ParallelDims` (one description of a parallel layout): a replica
of tp * ep ranks is `ParallelDims(dp=ep, tp=tp, ep=ep)`, so the expert group is carved out of the
"data" ranks exactly as in training and the mesh is the one `parallel/mesh.py` builds. Plain Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.parallel.dims import ParallelDims


@dataclass
class WorkerConfig:
    tp: int = 1  # tensor parallel: attention heads, MLP widths, vocabulary
    ep: int = 1  # expert parallel: routed experts
    # Bound on every collective during a step (and on start-up): a rank that stops answering
    # turns into an error after this long, never a hang. A rank that dies fails the step at once.
    timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.tp * self.ep

    def check_fields(self) -> None:
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"expected a positive integer, got {value!r}", field=name)
        if not self.timeout_s > 0:
            raise ConfigError(f"expected a positive number of seconds, got {self.timeout_s!r}", field="timeout_s")

    def dims(self, config: ModelConfig) -> ParallelDims:
        """The checked layout for `config` (ConfigError naming tp or ep when it does not fit the model)."""
        self.check_fields()
        dims = ParallelDims(dp=self.ep, tp=self.tp, ep=self.ep).resolve(config, self.world_size)
        if self.tp > 1 and config.vocab_size % self.tp != 0:
            raise ConfigError(f"tp = {self.tp} must divide vocab_size ({config.vocab_size}): the embedding and "
                              f"LM head are split by vocabulary", field="tp")
        return dims


def launched_by_torchrun() -> bool:
    """This process is a rank of a torchrun job (its environment names the rank and the world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
