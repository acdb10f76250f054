"""Activation offload: the tensors autograd saves inside chosen modules go to host memory in the
forward and come back for the backward (`torch.autograd.graph.saved_tensors_hooks`, the building
block of torch's `save_on_cpu`).

Targets, per trunk decoder layer:
  "layer"  the whole layer call. With activation checkpointing the layer is the checkpoint wrapper, so
           what it saves is the checkpoint's inputs (h and the AttnRes bank): offload + checkpointing
           keep neither the layer's inside (recomputed) nor its inputs on the device.
  "attn"   the attention / KDA block (projections, core, gate): its saved inputs and intermediates.
  "mlp"    the dense MLP or MoE block (router, experts' fc1 / activation inputs, shared experts).
"attn" and "mlp" sit inside a checkpointed layer, so they are refused with checkpointing (their hooks
would take the saved tensors from the checkpoint, and it would recompute nothing).

Parameters (and views of them: a linear saves W.T) stay where they are: only activations move. The
hooks are entered and left by the module's own forward pre/post hooks, so a pipeline schedule that
runs several microbatches' forwards (interleaved virtual stages too) before their backwards just
holds several sets of host copies. On a CPU the host is the device: a tensor is then kept in place
but counted as moved, so `OffloadStats` says what would leave an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from deltamoe.parallel.dims import OFFLOAD_INSIDE_LAYER


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the storage behind `t`. A DTensor (EP-sharded experts, TP weights) is a wrapper
    without storage of its own: its local shard's storage is what a forward reads and saves."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().data_ptr()


@dataclass
class OffloadStats:
    """Bytes of saved activations the hooks sent to the host (parameters excluded)."""

    moved_bytes: int = 0

    def take(self) -> int:
        """The bytes moved since the last call."""
        moved, self.moved_bytes = self.moved_bytes, 0
        return moved


class _ModuleOffload:
    """The pack/unpack hooks of one module, entered in its forward pre-hook and left in its forward hook."""

    def __init__(self, module: nn.Module, stats: OffloadStats):
        self.module, self.stats = module, stats
        self._contexts: list[saved_tensors_hooks] = []
        self._param_ptrs: set[int] | None = None

    def enter(self, module: nn.Module, args: Any) -> None:
        self._param_ptrs = None  # FSDP2 unshards into new storage per call: collected at the first pack
        ctx = saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self._contexts.append(ctx)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def _is_parameter(self, t: torch.Tensor) -> bool:
        if self._param_ptrs is None:
            self._param_ptrs = {storage_ptr(p) for p in self.module.parameters()}
        return storage_ptr(t) in self._param_ptrs

    def pack(self, t: torch.Tensor) -> Any:
        if self._is_parameter(t):
            return (None, t)
        self.stats.moved_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":  # the host is the device: counted, left in place
            return (None, t)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        return (t.device, host)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)


def _targets_of(layer: nn.Module, inner: nn.Module, target: str) -> list[nn.Module]:
    if target == "layer":
        return [layer]
    if target == "attn":
        return [inner.self_attn]
    return [getattr(inner, name) for name in ("mlp", "block_sparse_moe") if hasattr(inner, name)]


def apply_activation_offload(layers: nn.ModuleDict | nn.ModuleList, keys: list[str], targets: tuple[str, ...],
                             stats: OffloadStats) -> None:
    """Install the hooks on `targets` of the trunk layers `layers[key]`; call after activation checkpointing
    (a "layer" target is then the checkpoint wrapper)."""
    for key in keys:
        layer = layers[key] if isinstance(layers, nn.ModuleDict) else layers[int(key)]
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        if inner is not layer and any(t in OFFLOAD_INSIDE_LAYER for t in targets):
            raise ValueError(f"targets: {targets} sit inside a checkpointed layer; offload 'layer' with checkpointing")
        for target in targets:
            for module in _targets_of(layer, inner, target):
                hooks = _ModuleOffload(module, stats)
                module.register_forward_pre_hook(hooks.enter)
                module.register_forward_hook(hooks.leave, always_call=True)


class SavedBytesCounter:
    """Counts the bytes autograd saves outside any inner hooks (parameters excluded): wrap a forward in
    it to measure the activations a step keeps resident. Inner hooks (offload, checkpointing) take
    precedence, so what they handle is not counted here."""

    def __init__(self, params: list[torch.Tensor]):
        self.ptrs = {storage_ptr(p) for p in params}
        self.bytes = 0
        self._ctx = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if storage_ptr(t) not in self.ptrs:
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> "SavedBytesCounter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
