"""Activation checkpointing per decoder layer: keep each layer's input, recompute its inside in backward."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from deltamoe.parallel.stage_module import ModelStage


def apply_activation_checkpointing(stage: ModelStage) -> None:
    """Wrap the trunk layers (non-reentrant torch.utils.checkpoint). The wrapper's state-dict hooks drop its
    `_checkpoint_wrapped_module.` prefix, so checkpoints keep the published names. MTP layers are left
    unwrapped: the stage also calls their `logits` head, and they are few."""
    for key in stage.trunk_keys:
        stage.model.layers[key] = checkpoint_wrapper(stage.model.layers[key])
