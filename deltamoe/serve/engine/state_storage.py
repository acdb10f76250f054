"""Where the KDA state slots live in memory: slot-major, a slot's state of every layer in one run.

The engine reads and writes state as `recurrent[layer, slot]` / `conv[layer, slot]` ([layers, slots, ...]
indexing, a layer's slots as `recurrent[layer]`). Each is a [layers, slots, ...] view of a buffer laid
out [slot][layer], so a slot's recurrent state of every layer is one contiguous run, and so is its conv
state: a hand-off moves a request's whole state as two write segments, not two per KDA layer. A layer's
view stays a view (no copy on the decode path), strided by a slot's run instead of by one layer's state.

Recurrent and conv state keep a buffer each: a compiled region writes both in place, and the compiler
does not take two written inputs that share one storage (views of one buffer would be one segment).
"""

from __future__ import annotations

import torch


def slot_major(num_layers: int, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed [num_layers, num_slots, *shape] state pool whose slots are each one run of every layer."""
    return torch.zeros(num_slots, num_layers, *shape, dtype=dtype, device=device).transpose(0, 1)


def slot_run_bytes(state: torch.Tensor) -> int:
    """Bytes between the starts of two consecutive slots of a `slot_major` pool (its slot stride)."""
    return state.stride(1) * state.element_size()
