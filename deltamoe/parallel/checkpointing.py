"""Activation checkpointing per decoder layer: keep each layer's input, recompute its inside in backward."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torch import nn


def apply_activation_checkpointing(layers: nn.ModuleDict | nn.ModuleList, keys: list[str]) -> None:
    """Wrap the trunk layers `layers[key]` (a stage's ModuleDict, or the whole model's ModuleList with keys
    "0", "1", ...) in non-reentrant torch.utils.checkpoint. The wrapper's state-dict hooks drop its
    `_checkpoint_wrapped_module.` prefix, so checkpoints keep the published names. MTP layers are left
    unwrapped: the stage also calls their `logits` head, and they are few."""
    for key in keys:
        index = key if isinstance(layers, nn.ModuleDict) else int(key)
        layers[index] = checkpoint_wrapper(layers[index])
