"""Where the KDA state slots live in memory: slot-major, every layer's recurrent and conv state of a slot in one run.

The engine reads and writes state as `recurrent[layer, slot]` / `conv[layer, slot]` ([layers, slots, ...]
indexing, a layer's slots as `recurrent[layer]`). Those tensors are views of one byte buffer laid out
[slot][recurrent of every layer | conv of every layer], so a slot's whole state, both kinds, is one
contiguous run of `slot_bytes`: a hand-off moves it as one write segment, not two per KDA layer, and
copying or zeroing a slot touches one run. A layer's view stays a view (no copy on the decode path),
strided by a slot's bytes instead of by a layer's state.
"""

from __future__ import annotations

import math

import torch

SLOT_ALIGN = 64  # each slot's run starts on a cache line


def slot_major_states(num_layers: int, num_slots: int, recurrent_shape: tuple[int, ...], conv_shape: tuple[int, ...],
                      recurrent_dtype: torch.dtype, conv_dtype: torch.dtype, device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(recurrent [num_layers, num_slots, *recurrent_shape], conv [num_layers, num_slots, *conv_shape]), zeroed:
    views of one buffer in which each slot's state of every layer, recurrent then conv, is one run."""
    recurrent_bytes = num_layers * math.prod(recurrent_shape) * _element_bytes(recurrent_dtype)
    conv_offset = _aligned(recurrent_bytes, _element_bytes(conv_dtype))
    conv_bytes = num_layers * math.prod(conv_shape) * _element_bytes(conv_dtype)
    slot_bytes = _aligned(conv_offset + conv_bytes, SLOT_ALIGN)
    buffer = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
    recurrent = _part(buffer, 0, recurrent_bytes, recurrent_dtype, num_layers, recurrent_shape)
    conv = _part(buffer, conv_offset, conv_bytes, conv_dtype, num_layers, conv_shape)
    return recurrent, conv


def slot_run_bytes(state: torch.Tensor) -> int:
    """Bytes between the starts of two consecutive slots of a `slot_major_states` tensor (its slot stride)."""
    return state.stride(1) * state.element_size()


def _part(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, num_layers: int,
          shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of every slot's run as [num_layers, num_slots, *shape] of `dtype`."""
    part = buffer[:, offset:offset + nbytes].view(dtype)  # [slots, elements], slot stride in elements
    return part.view(buffer.shape[0], num_layers, *shape).transpose(0, 1)


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align
