"""Shape validation shared by the ops: one error format that names the tensor and the expected shape."""

from __future__ import annotations

from typing import Sequence

import torch


def check_shape(name: str, tensor: torch.Tensor, dims: str, expected: Sequence[int | None]) -> None:
    """Raise ValueError naming `name` unless its shape matches `expected` (None = any size)."""
    actual = tuple(tensor.shape)
    if len(actual) != len(expected) or any(e is not None and e != a for e, a in zip(expected, actual)):
        shown = ", ".join("?" if e is None else str(e) for e in expected)
        raise ValueError(f"{name}: expected shape {dims} = ({shown}), got {actual}")
